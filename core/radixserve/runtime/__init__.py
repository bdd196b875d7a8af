"""Multi-process runtime: typed IPC messages, the detokenizer, process launch and the TokenizerManager."""
