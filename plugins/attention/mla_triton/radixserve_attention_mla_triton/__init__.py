"""RadixServe attention plugin: latent attention (MLA) with Triton kernels."""
