"""radixserve-spec-ngram: an n-gram drafter (prompt and history lookup) for speculative decoding."""
