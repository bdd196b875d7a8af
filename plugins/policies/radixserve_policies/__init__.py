"""Schedule policies for RadixServe (registered in `radixserve_policies.plugin`)."""
