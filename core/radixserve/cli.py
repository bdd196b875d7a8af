"""The `radixserve` command line: plugins, config show, serve, generate, bench.

Subcommands whose implementation lives in its own module are imported lazily so `radixserve
plugins` stays fast and works without torch being importable."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from radixserve.config import Config, ConfigError, deep_merge, parse_dotted_overrides, with_env_api_key
from radixserve.peer_options import hint_for
from radixserve.plugins.model_select import FALLBACK_CLAIM, FALLBACK_DISTRIBUTION, FALLBACK_MODEL, fallback_spec
from radixserve.plugins.registry import PluginError, Registry
from radixserve.plugins.stack import CONFIG_KEY_OF_KIND, resolve_stack


def _deny_list(values: list[str] | None) -> list[str]:
    """`-p no:NAME` (pytest style) -> [NAME]."""
    out = []
    for v in values or []:
        if not v.startswith("no:"):
            raise ConfigError(f"-p {v!r}: only the deny form -p no:PLUGIN is supported")
        if not v[3:].strip():  # `-p no:$NAME` with NAME unset would disable nothing without a word
            raise ConfigError(f"-p {v!r}: the plugin name is missing (-p no:PLUGIN; radixserve plugins lists them)")
        out.append(v[3:])
    return out


def _disable_overrides(args: argparse.Namespace) -> dict:
    """`-p no:NAME` becomes plugins.disable, so it travels with the config to every process."""
    deny = _deny_list(getattr(args, "p", None))
    return {"plugins": {"disable": deny}} if deny else {}


# ---- plugins ---------------------------------------------------------------------------------
def cmd_plugins(args: argparse.Namespace) -> int:
    reg = Registry.discover(deny=set(_deny_list(args.p)), keep_going=True)
    rows = [
        {
            "distribution": s.distribution,
            "version": s.version,
            "plugin": s.plugin,
            "kind": s.kind,
            "name": s.name,
            "devices": list(s.devices),
            "priority": s.priority,
            "description": s.description,
            "weight_file_suffixes": list(s.weight_file_suffixes),
            "ref": s.ref,  # "module:Class", as registered (not imported here)
        }
        for s in reg.components()
    ]
    claims = _architecture_claims(reg)
    if args.json:
        broken = [{"plugin": name, "distribution": dist, "error": why} for name, (dist, why) in sorted(reg.broken.items())]
        conflicts = [{"component": key, "error": why} for key, why in sorted(reg.conflicts.items())]
        skipped = [{"plugin": name, "distribution": dist, "reason": why} for name, (dist, why) in sorted(reg.skipped.items())]
        print(json.dumps({"plugins": [vars(p) for p in reg.plugins.values()], "components": rows,
                          "architectures": claims, "broken": broken, "conflicts": conflicts, "skipped": skipped},
                         indent=2))
        return 1 if broken or conflicts else 0
    # plugin: the entry-point name that -p no:NAME, plugins.disable and the allow-list take
    headers = ["plugin", "distribution", "version", "kind", "name", "devices", "priority"]
    table = [[r["plugin"], r["distribution"], r["version"], r["kind"], r["name"], ",".join(r["devices"]),
              str(r["priority"])] for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)))
    print("\nmodel architectures (model.impl: auto takes the native plugin, else the transformers fallback; "
          "model.impl: transformers runs a native one through the fallback too):")
    width = max([len(c["architecture"]) for c in claims] + [12])
    for c in claims:
        print(f"  {c['architecture'].ljust(width)}  {c['path'].ljust(8)}  {c['distribution']}")
    if not any(c["path"] == "fallback" for c in claims):
        print(f"  (other architectures: none; pip install {FALLBACK_DISTRIBUTION} runs any AutoModelForCausalLM)")
    sources = sorted((suffix, r["name"], r["distribution"]) for r in rows for suffix in r["weight_file_suffixes"])
    print("\ncheckpoint files (a model.path ending so is read by that weight source; directories: safetensors):")
    readers: dict[str, list[str]] = {}
    for suffix, name, _dist in sources:
        readers.setdefault(suffix, []).append(name)
    for suffix, name, dist in sources:
        # several readers of one suffix: the registry's order (priority, then name) picks; say which (weight-source
        # audit 34: the other was silently shadowed, the default model's .gguf included)
        winner = reg.weight_source_for(f"x{suffix}") if len(readers[suffix]) > 1 else None
        note = "" if winner is None else ("  (reads these files)" if winner.name == name else
                                          f"  (not used: {winner.name!r} comes first; -p no:<plugin> to switch)")
        print(f"  {suffix.ljust(12)}  {name.ljust(12)}  {dist}{note}")
    if not sources:
        print("  (none installed)")
    if reg.skipped:
        print("\nplugins installed but not loaded:")
        for name, (dist, why) in sorted(reg.skipped.items()):
            print(f"  {name} ({dist}): {why}")
    if reg.broken:  # listed, not fatal here: every other command refuses to start with these installed
        print("\nplugins that failed to load (every other command stops on them; fix, uninstall or -p no:NAME):")
        for name, (dist, why) in sorted(reg.broken.items()):
            print(f"  {name} ({dist}): {why}")
    if reg.conflicts:  # left out of the table above: every other command stops on them
        print("\ncomponents registered twice (every other command stops on them):")
        for key, why in sorted(reg.conflicts.items()):
            print(f"  {key}: {why}")
    return 1 if reg.broken or reg.conflicts else 0


def _architecture_claims(reg: Registry) -> list[dict]:
    """Who runs which architecture: each native model component, then the fallback if installed."""
    out = [{"architecture": s.name, "path": "native", "distribution": s.distribution}
           for s in reg.components("model") if s.name != FALLBACK_MODEL]
    out.sort(key=lambda c: c["architecture"])
    fallback = fallback_spec(reg)
    if fallback is not None:
        out.append({"architecture": FALLBACK_CLAIM, "path": "fallback",
                    "distribution": fallback.distribution})
    return out


# ---- config ----------------------------------------------------------------------------------
def load_config_from_args(args: argparse.Namespace, extra: dict | None = None) -> Config:
    """YAML (--config) < dotted overrides < `extra` (flags); `-p no:NAME` adds to plugins.disable."""
    config = Config.load(getattr(args, "config", None), parse_dotted_overrides(getattr(args, "overrides", None) or []))
    overrides = deep_merge(extra or {}, _disable_overrides(args))
    if "plugins" in overrides:  # -p adds to the stack's list instead of replacing it
        overrides["plugins"]["disable"] = list(config.plugins.disable) + overrides["plugins"]["disable"]
    config = config.with_overrides(overrides) if overrides else config
    config.check_speculative_settings_used()
    return config


def _redacted_yaml(config: Config) -> str:
    """The config as YAML with the API key shown as *** (as /server_info shows it): `config show`
    output ends up in bug reports and terminal scrollback."""
    return (config.with_overrides({"server": {"api_key": "***"}}) if config.server.api_key else config).to_yaml()


def cmd_config_show(args: argparse.Namespace) -> int:
    from radixserve.model_loader.model_files import default_model_path
    from radixserve.plugins.attention_class import check_attention_class, head_dim_before_loading

    # the key `serve` would take ($RADIXSERVE_API_KEY under the YAML and the command line)
    flags = {key: value for key, value in (("path", args.model), ("tokenizer", args.tokenizer)) if value}
    config = with_env_api_key(load_config_from_args(args, {"model": flags} if flags else None))
    reg = Registry.from_config(config)
    device = config.runtime.resolved_device()
    _warn_device_unusable(config)
    checkpoint = None
    # the model serve and generate would run: the one given, else the default (the embedded GGUF), resolved
    # the same way (newcomer audit 34: without --model its weight source went unreported)
    model_path = config.model.path or default_model_path()
    if model_path is not None:  # resolved as the runner resolves it: the model's KV kind picks attention
        from radixserve.model_loader.sources import open_checkpoint

        model_config = config if config.model.path else config.with_overrides({"model": {"path": model_path}})
        resolve_stack(model_config, reg, device)  # the stack's own errors first, as at start-up
        checkpoint = open_checkpoint(model_config, reg)
        cls = checkpoint.choice.cls
        attention_type = getattr(cls, "attention_type", "standard")
        resolved = resolve_stack(model_config, reg, device, checkpoint.path, attention_type=attention_type,
                                 model_name=f"model architecture {checkpoint.choice.architecture!r}",
                                 head_dim=head_dim_before_loading(cls, checkpoint.hf_config, attention_type))
        _check_quant_method_builds(checkpoint, resolved, reg, model_config, device)
    else:  # no model to ask about (the default is not installed): the attention class as the runner builds it
        resolved = resolve_stack(config, reg, device)
        name = resolved.attention.name
        check_attention_class(reg.load("attention", name), name, device, config.runtime.resolved_dtype(device), None)
    # the checkpoint's own method when the stack names none (its errors before anything is printed)
    own_quant = _checkpoint_quantization(checkpoint, resolved, reg) if checkpoint and not resolved.quantization else None
    print(_redacted_yaml(config), end="")
    print(f"# resolved for device {device} (dtype {config.runtime.resolved_dtype(device)}):")
    print("resolved_stack:  # kind: component (chosen by stack.<key>)")
    for kind, spec in resolved.by_kind().items():
        key = f"stack.{CONFIG_KEY_OF_KIND[kind]}"
        if kind == "quantization" and own_quant is not None:
            spec, key = own_quant
        if spec is None:
            print(f"  {kind}: null  # {key}")
            continue
        print(f"  {kind}: {spec.name}  # {key}; {spec.distribution} {spec.version}")
        if kind == "prefix_cache" and resolved.prefix_cache_options:
            print(f"  prefix_cache_options: {resolved.prefix_cache_options}")
        if kind == "policy" and resolved.policy_options:
            print(f"  policy_options: {resolved.policy_options}")
        if kind == "drafter" and resolved.drafter_options:
            print(f"  drafter_options: {resolved.drafter_options}  # speculative.options")
    _show_output_parsers(config, reg)
    if reg.skipped:  # plugins.disable is in the YAML above; the environment's lists are not
        print("skipped_plugins:  # installed, not loaded")
        for plugin, (dist, why) in sorted(reg.skipped.items()):
            print(f"  {plugin}: {json.dumps(why)}  # {dist}")
    if checkpoint is not None:  # which implementation would run it (reads only the config); its own key, so the
        # output stays one YAML document (the config above already has `model:`)
        print(f"model_implementation: {json.dumps(checkpoint.choice.describe())}")
    return 0


def _warn_device_unusable(config: Config) -> None:
    """`config show` resolves a stack for a device this machine may lack (a GPU stack checked on a laptop is
    fine), but says on stderr that serve and generate would refuse it here (newcomer audit 34: it passed a CUDA
    stack on a CPU-only host without a word, and generate then exited 2)."""
    try:
        config.runtime.check_device_usable()
    except ConfigError as e:
        print(f"radixserve: note: {e}: serve and generate refuse this config on this machine", file=sys.stderr)


def _check_quant_method_builds(checkpoint: Any, resolved: Any, reg: Registry, config: Config, device: str) -> None:
    """The quantization method built as start-up builds it for an HF checkpoint (its `from_config` on the
    checkpoint's quantization_config or None, its `check_device`; an abstract class refused): no weights
    are read, so `config show` refuses what serve and generate would. A file's weight source is its own
    method (built when the file was opened)."""
    if checkpoint.source.weight_source is not None:
        return
    import torch

    from radixserve.model_loader.quant_select import build_quant_method, chosen_quant_method, quant_label
    from radixserve.model_runner import check_quant_tensor_parallel

    choice = chosen_quant_method(reg, resolved, checkpoint.hf_config)
    method = build_quant_method(reg, choice, torch.device(device), getattr(torch, config.runtime.resolved_dtype(device)))
    # the instance's own flag (one mode of a method may not split over ranks), as the model runner checks it
    check_quant_tensor_parallel(method, config.runtime.tp_size, quant_label(choice.spec), choice.built_by)


def _checkpoint_quantization(checkpoint: Any, resolved: Any, reg: Registry) -> tuple[Any, str]:
    """The quantization method the model's layers would use without stack.quantization, and why: a file's
    weight source (GGUF), or an HF directory's quantization_config.quant_method (an error when no installed
    plugin provides it, as at start-up), or the default."""
    from radixserve.model_loader.quant_select import chosen_quant_method

    if checkpoint.source.weight_source is not None:  # the file type's source, or the one model.load_format names
        reader = reg.weight_source_named(checkpoint.source.format)
        by_suffix = reg.weight_source_for(checkpoint.path)
        return reader, ("the weight source of this file type" if by_suffix is not None and by_suffix.name == reader.name
                        else "the weight source model.load_format names")
    choice = chosen_quant_method(reg, resolved, checkpoint.hf_config)
    return choice.spec, choice.source


def _show_output_parsers(config: Config, reg: Registry) -> None:
    """The HTTP layer's parsers (server.*): named ones are checked as `serve` checks them."""
    from radixserve.server.parser_selection import OFF, check_parser_names

    check_parser_names(config, reg)
    print("output_parsers:  # kind: component (chosen by server.<key>; used by `serve` only)")
    for kind, key in (("tool_parser", "tool_call_parser"), ("reasoning_parser", "reasoning_parser")):
        wanted = getattr(config.server, key)
        if wanted is None:
            print(f"  {kind}: null  # server.{key}: detected from the model's chat template")
        elif wanted == OFF:
            print(f"  {kind}: {OFF}  # server.{key}")
        else:
            spec = reg.get(kind, wanted)
            print(f"  {kind}: {wanted}  # server.{key}; {spec.distribution} {spec.version}")


# ---- commands implemented in their own modules -------------------------------------------------
def _lazy(module: str, adder: str, runner: str, what: str) -> tuple[Callable | None, Callable]:
    """Return (add_arguments, run) from `module`, or a runner that explains what is missing."""
    import importlib

    try:
        mod = importlib.import_module(module)
        return getattr(mod, adder), getattr(mod, runner)
    except ImportError as e:
        if e.name and not e.name.startswith("radixserve"):
            raise  # a real missing dependency: let it surface with its name

        def missing(args: argparse.Namespace) -> int:
            print(f"radixserve: `{what}` is not available in this build ({module} is missing)", file=sys.stderr)
            return 2

        return None, missing


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_cmd is None:
        print("radixserve bench: choose one of: one-batch, serve", file=sys.stderr)
        return 2
    return args.bench_func(args)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="RadixServe LLM serving runtime")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.subcommands = sub.choices  # type: ignore[attr-defined]  # name -> parser: errors show the command's usage

    def common(p: argparse.ArgumentParser, config: bool = True) -> None:
        p.add_argument("-p", action="append", metavar="no:PLUGIN", help="do not load this plugin (repeatable)")
        if config:
            p.add_argument("--config", metavar="FILE", help="YAML component stack (see stacks/)")

    p = sub.add_parser("plugins", help="list installed plugins and their components")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    common(p, config=False)
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_cmd", metavar="ACTION", required=True)
    show = csub.add_parser("show", help="print the fully resolved configuration and component stack")
    common(show)
    show.add_argument("--model", help="also say which model implementation runs this checkpoint (model.path)")
    show.add_argument("--tokenizer", metavar="DIR", help="the tokenizer directory (model.tokenizer), as serve and "
                      "generate take it")
    show.add_argument("overrides", nargs="*", default=[], metavar="section.key=value", help="overrides (beat the YAML)")
    show.set_defaults(func=cmd_config_show)

    for name, module, helptext in (
        ("serve", "radixserve.cli_serve", "serve an OpenAI-compatible HTTP API"),
        ("generate", "radixserve.cli_generate", "complete one prompt and print it"),
    ):
        adder, runner = _lazy(module, f"add_{name}_arguments", f"run_{name}", f"radixserve {name}")
        p = sub.add_parser(name, help=helptext)
        if adder is not None:
            adder(p)
        else:
            p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=runner)

    p = sub.add_parser("bench", help="benchmarks: one-batch (in-process) and serve (load generator)")
    bsub = p.add_subparsers(dest="bench_cmd", metavar="BENCH")
    for name, module, helptext in (
        ("one-batch", "radixserve.bench.one_batch", "static-batch prefill and decode timings, in this process"),
        ("serve", "radixserve.bench.serve", "a load generator for any OpenAI-compatible server"),
    ):
        adder, runner = _lazy(module, "add_arguments", "run", f"radixserve bench {name}")
        bp = bsub.add_parser(name, help=helptext)
        if adder is not None:
            adder(bp)
        else:
            bp.add_argument("rest", nargs=argparse.REMAINDER)
        bp.set_defaults(bench_func=runner)
    p.set_defaults(func=cmd_bench)
    return parser


def _version() -> str:
    from radixserve.version import __version__

    return __version__


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, except that `section.key=value` overrides may also follow flags that
    follow a positional (`generate "prompt" --max-tokens 16 stack.policy=lpm`): argparse fills a
    `nargs="*"` positional only once, and would reject the overrides after the flags."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        strays = [a for a in extra if a.startswith("-") or "=" not in a]
        if strays or not hasattr(args, "overrides"):
            # the subcommand's usage, not the top level's; a vLLM/SGLang flag gets its spelling here
            command = getattr(parser, "subcommands", {}).get(getattr(args, "command", None), parser)
            hints = [h for h in (hint_for(a) for a in strays if a.startswith("-")) if h]
            if getattr(args, "command", None) == "config" and any(a.startswith("-") for a in strays) and not hints:
                hints.append("config show takes serve's settings as section.key=value overrides (--port is "
                             "server.port=8000); docs/configuration.md lists the keys")
            command.error(f"unrecognized arguments: {' '.join(extra)}" + "".join(f"\n  {h}" for h in hints))
        args.overrides = [*(args.overrides or []), *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parse_command_line(parser, argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe fails here, inside the handler below, not at exit
        return code
    except BrokenPipeError:  # `radixserve plugins | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        return 0
    except (ConfigError, PluginError, FileNotFoundError, ValueError) as e:
        # user errors (bad path, bad value, unknown component) get one line naming the value;
        # RADIXSERVE_DEBUG=1 shows the traceback for bug reports
        if os.environ.get("RADIXSERVE_DEBUG"):
            raise
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
