"""Speculative decoding on the scheduler side: drafts in (`drafts`), the low-acceptance safeguard
(`adaptive`), building the configured drafter (`setup`) and the built-in `oracle` drafter.

The verify forward itself is an EXTEND batch run by the model runner (`ScheduledBatch.spec`); the
scheduler turns its per-node target tokens into accepted tokens here (`drafts.accepted_path`)."""
