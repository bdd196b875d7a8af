"""CPU checks of the EAGLE-3 draft's device code paths (issue 13, session 8 call 5's regression), on a
tiny target + draft with Triton's interpreter standing in for the GPU:

- `keys`: every Triton launch during `propose` (RMSNorm, rotary, the batch-1 GEMV with tiles forced,
  as on the H200) recorded with the key Triton's JIT caches compiled kernels under (each argument's
  specialisation as `triton.runtime.jit` computes it, the constexprs, the launch options): a kernel
  whose set of keys grows with the proposes would compile once per step on a GPU.
- `syncs`: the functions the draft graphs capture (chain, verified rows, tree) run under a dispatch /
  function mode that counts host synchronisations and host-made tensors (`item`, `tolist`,
  `nonzero`, `torch.tensor(...)`, ...), none of which a CUDA graph capture allows.
- `cycle`: spec_eagle.py's flow (a drafter per pass, each dropped before the next is built), three
  drafters with graphs: when each one's captured graphs are destroyed (by refcounts when its
  scheduler is dropped, or only by a later cyclic GC pass).

    TRITON_INTERPRET=1 python benchmarks/eagle_draft_cpu_checks.py keys  [--graphs] [--tokens 20] [--topk 1]
    TRITON_INTERPRET=1 python benchmarks/eagle_draft_cpu_checks.py syncs [--tokens 16] [--topk 1]
    python benchmarks/eagle_draft_cpu_checks.py cycle

Session 10's figures (18 proposes each): keys, eager chains, graph chains (--graphs) and eager trees
(--topk 3): rmsnorm 2 keys (HAS_RESIDUAL both ways), rotary 1, gemv 1, all from the first propose;
syncs: 0 in 38 captures / replays (chains) and 0 in 37 (trees, --topk 3); cycle (--tokens 40): no
drafter's graphs died with its scheduler; A's were destroyed by the GC during pass B, B's during C.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports a kernel
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/speculative/eagle/tests"))


DRAFTING = {"on": False, "propose": 0, "capturing": False}


def record_kernel_keys() -> dict:
    """Patch the interpreter's launch to record, while drafting, each kernel's JIT cache key."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime import interpreter
    from triton.runtime.jit import native_specialize_impl

    keys: dict = collections.defaultdict(lambda: collections.defaultdict(set))  # kernel -> key -> proposes
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if DRAFTING["on"]:
            sig = inspect.signature(self.fn)
            bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
            spec = []
            for name, p in sig.parameters.items():
                v = bound.arguments.get(name, p.default)
                if "constexpr" in str(p.annotation):
                    spec.append((name, repr(v)))
                else:
                    spec.append((name, *native_specialize_impl(BaseBackend, v, False, True, True)))
            options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters))
            keys[self.fn.__name__][(tuple(spec), options)].add(DRAFTING["propose"])
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run
    return keys


HOST_OPS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default",
            "aten.lift_fresh.default", "aten.masked_select.default", "aten.is_nonzero.default",
            "aten.equal.default", "aten._unique2.default", "aten.unique_consecutive.default"}
HOST_METHODS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy"}


def guarded_graph_class(hits: collections.Counter):
    """An EagerGraph whose capture and replay count host synchronisations (by call site)."""
    from radixserve.cuda_graph_runner import EagerGraph
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    def where() -> tuple:
        frames = [f for f in traceback.extract_stack() if "radixserve" in f.filename][-3:]
        return tuple(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames)

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in HOST_OPS:
                hits[(str(func), where())] += 1
            return func(*args, **(kwargs or {}))

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in HOST_METHODS:
                hits[(func.__name__, where())] += 1
            return func(*args, **(kwargs or {}))

    class GuardedGraph(EagerGraph):
        runs = 0

        def capture(self, fn):
            GuardedGraph.runs += 1
            with Function(), Dispatch():
                return super().capture(fn)

        def replay(self):
            GuardedGraph.runs += 1
            with Function(), Dispatch():
                return super().replay()

    return GuardedGraph


def dropped_graphs(make_scheduler, run) -> None:
    """Three passes, each with a new scheduler + drafter dropped at its end; prints when each
    drafter's captured graphs were destroyed."""
    import gc
    import weakref

    phase = ["set-up"]
    events: list[tuple[str, str]] = []  # (drafter, phase in which one of its graphs was destroyed)

    def one(name: str) -> None:
        sched = make_scheduler()
        phase[0] = f"pass {name}"
        run(sched)
        for graph, _ in [*sched.drafter.graphs.chains.values(), *sched.drafter.graphs.pendings.values()]:
            weakref.finalize(graph, lambda: events.append(
                (name, phase[0] + (", inside a capture" if DRAFTING["capturing"] else ""))))
        phase[0] = f"dropping pass {name}'s scheduler (refcounts)"
        del sched
        phase[0] = f"after pass {name}"

    for name in "ABC":
        one(name)
    phase[0] = "an explicit gc.collect() after the passes"
    gc.collect()
    first: dict[str, str] = {}
    for name, at in events:
        first.setdefault(name, at)
    for name in "ABC":
        print(f"drafter {name}'s graphs destroyed: {first.get(name, 'never')}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("check", choices=("keys", "syncs", "cycle"))
    ap.add_argument("--graphs", action="store_true", help="keys: the graph path (EagerGraph) instead of eager")
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--topk", type=int, default=1)
    args = ap.parse_args()

    from eagle_checkpoints import target_config, write_eagle3
    from radixserve.config import Config
    from radixserve.cuda_graph_runner import EagerGraph
    from radixserve.layers import triton_ops
    from radixserve.layers.triton_gemv import default_config
    from radixserve.model_runner import ModelRunner
    from radixserve.testing import run_to_completion, tiny_checkpoint
    from radixserve.testing.speculative import greedy_request, speculative_scheduler
    from radixserve_spec_eagle.drafter import EagleDrafter

    keys = record_kernel_keys()
    hits: collections.Counter = collections.Counter()
    graph_cls = guarded_graph_class(hits) if args.check == "syncs" else EagerGraph
    if args.check == "cycle":
        class MarkedGraph(EagerGraph):
            def capture(self, fn):
                DRAFTING["capturing"] = True
                try:
                    return super().capture(fn)
                finally:
                    DRAFTING["capturing"] = False

        graph_cls = MarkedGraph
    real_available = triton_ops.available
    triton_ops.available = lambda t: DRAFTING["on"] or real_available(t)  # the draft's layers on Triton

    tmp = tempfile.mkdtemp()
    path = tiny_checkpoint("llama", f"{tmp}/target", seed=3, num_hidden_layers=3)
    draft = write_eagle3(f"{tmp}/eagle3", target_config(path), seed=2)
    runner = ModelRunner(Config.build({
        "model": {"path": path}, "stack": {"attention": "torch_native"},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
        "scheduler": {"max_total_tokens": 4000, "max_running_requests": 4}}), show_progress=False)
    cfg = Config.build({
        "stack": {"prefix_cache": "radix", "speculative": "eagle"},
        "speculative": {"num_draft_tokens": 6 if args.topk > 1 else 4, "topk": args.topk,
                        "num_steps": 3 if args.topk > 1 else None, "draft_model_path": draft, "adaptive_batch_size": 0},
        "scheduler": {"max_total_tokens": 4000}})

    class Drafter(EagleDrafter):
        graph_factory = graph_cls

        def __init__(self, info):
            super().__init__(info, cuda_graph=args.graphs or args.check != "keys")
            head = self.head  # the GEMV tiles the H200 would give (none on a CPU device)
            head.tiles = {"fc": default_config(*head.fc.weight.shape, True),
                          "lm_head": default_config(*head.lm_head.weight.shape, True)}
            for layer in head.layers:
                layer.tiles = {name: default_config(*w.shape, True) for name, w in
                               (("qkv", layer.qkv_weight), ("o", layer.o_proj.weight),
                                ("gate_up", layer.gate_up_weight), ("down", layer.down_proj.weight))}

        def propose(self, reqs, k):
            DRAFTING["on"], DRAFTING["propose"] = True, DRAFTING["propose"] + 1
            try:
                return super().propose(reqs, k)
            finally:
                DRAFTING["on"] = False

    if args.check == "cycle":
        dropped_graphs(lambda: speculative_scheduler(runner, cfg, lambda info, c: Drafter(info)),
                       lambda sched: run_to_completion(sched, [greedy_request("r", list(range(3, 40)), args.tokens)]))
        return
    sched = speculative_scheduler(runner, cfg, lambda info, c: Drafter(info))
    run_to_completion(sched, [greedy_request("r", list(range(3, 40)), args.tokens)])
    g = sched.drafter.graphs
    print(f"proposes: {DRAFTING['propose']}; draft graphs: "
          f"{None if g is None else sorted(map(str, [*g.chains, *g.pendings, *g.trees]))}")
    if args.check == "keys":
        for kernel, by_key in sorted(keys.items()):
            firsts = sorted(min(p) for p in by_key.values())
            print(f"{kernel}: {len(by_key)} keys, first seen at proposes {firsts}")
    else:
        print(f"host synchronisations in {graph_cls.runs} captures / replays: {sum(hits.values())}")
        for (op, at), n in hits.most_common():
            print(f"  {n} x {op} at {' <- '.join(reversed(at))}")


if __name__ == "__main__":
    main()
