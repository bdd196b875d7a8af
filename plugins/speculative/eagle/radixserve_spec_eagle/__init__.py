"""radixserve-spec-eagle: EAGLE-2 and EAGLE-3 draft heads (see docs/speculative.md, "EAGLE")."""
