"""radixserve-spec-mtp: DeepSeek-V3's multi-token-prediction layer as a drafter (see docs/speculative-drafters.md, "MTP")."""
