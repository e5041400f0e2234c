"""Transformer Engine's one home: the only package that imports transformer_engine or touches its FP8
tensors' internals.

- recipes.py: the FP8 recipes by `fp8.recipe` name;
- policy.py:  FP8Policy, what the [fp8] section means for models, parallelisms, optimizers and the step;
- layers.py:  the `te` layer backend (TE's TransformerLayer as a block a family configures);
- tensors.py: FP8 tensors from the outside (written in place by optimizers, quantized by the head);
- kernels.py: TE's Adam kernels and FusedAdam for the optimizers;
- swiglu.py:  SwiGLU's derivative fused with its FP8 cast (fp8.fused_swiglu; the Triton kernel in
              swiglu_kernels.py);
- stats.py:   delayed-scaling statistics for the metrics;
- checks.py:  what this GPU and cuDNN can run of the [fp8] section.
A TE upgrade reads this package; nothing outside it needs to change.
"""
