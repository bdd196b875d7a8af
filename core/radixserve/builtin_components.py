"""Components that ship with the core itself, registered through the same hook as any plugin."""

from radixserve.plugins.hookspec import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "quantization",
        "unquantized",
        "radixserve.layers.quant_unquantized:UnquantizedMethod",
        description="plain floating-point weights (the default)",
    )
    registry.register(
        "drafter",
        "oracle",
        "radixserve.scheduler.speculative.oracle:OracleDrafter",
        description="benchmark drafter: proposes stored greedy continuations (known acceptance)",
    )

    # chat output parsers (the HTTP layer picks one per model: server.tool_call_parser /
    # server.reasoning_parser, else by the markers in the chat template, higher priority first)
    for name, ref, priority, description in (
        ("mistral", "mistral:MistralToolParser", 40, "Mistral [TOOL_CALLS] (JSON list or name[ARGS]{...})"),
        ("hermes", "hermes:HermesToolParser", 30, "Hermes / Qwen <tool_call>{json}</tool_call>"),
        ("pythonic", "pythonic:PythonicToolParser", 20, "Python call list [f(a=1), g(b='x')] (Llama 3.2/4)"),
        ("llama3_json", "llama3_json:Llama3JsonToolParser", 10, 'Llama 3.x {"name", "parameters"} JSON'),
    ):
        registry.register(
            "tool_parser", name, f"radixserve.server.tool_parsers.{ref}", priority=priority, description=description
        )
    registry.register(
        "reasoning_parser", "deepseek_r1", "radixserve.server.reasoning:DeepSeekR1ReasoningParser", priority=20,
        description="<think>...</think>; the output starts inside the reasoning (DeepSeek-R1)",
    )
    registry.register(
        "reasoning_parser", "qwen3", "radixserve.server.reasoning:Qwen3ReasoningParser", priority=10,
        description="<think>...</think> at the start of the output (Qwen3, QwQ)",
    )
