"""Component registry: discovers plugin distributions and resolves (kind, name) to classes.

Discovery walks the entry-point group `radixserve.plugins`; each plugin module is checked for a
compatible `PLUGIN_API` range, then its `radixserve_register` hook declares components with lazy
"module:Class" references. Nothing is imported beyond the plugin modules until `load()`.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from radixserve.plugins import hookspec
from radixserve.version import PLUGIN_API_VERSION

ENTRY_POINT_GROUP = "radixserve.plugins"
ALLOW_ENV = "RADIXSERVE_PLUGINS"  # comma-separated plugin (entry-point) names to load; others skipped
DENY_ENV = "RADIXSERVE_DISABLE_PLUGINS"  # comma-separated plugin names never to load

logger = logging.getLogger(__name__)


# model.load_format values that name no weight source (any other value is a weight source's name)
BUILTIN_LOAD_FORMATS = ("auto", "safetensors", "dummy")

# the device types a component may declare with `register(devices=...)`: runtime.device's values
# other than "auto" (a test keeps the two equal)
DEVICE_TYPES = ("cpu", "cuda")

# the hooks pluggy calls (registry.hook.<name>): only functions decorated with @hookimpl are seen
# by it, unlike radixserve_register, which discovery calls directly
_PLUGGY_HOOKS = ("radixserve_add_routes", "radixserve_stats")


class PluginError(RuntimeError):
    """A plugin or component problem the user must fix (bad name, conflict, version mismatch)."""


class PluginCodeError(PluginError):
    """A component's own code raised while the runtime used it at start-up (e.g. a quantization
    method's `create_weights` or `apply` in the warm-up): one line naming the component, the hook and
    the layer, like every PluginError, with the component's exception as `__cause__`. Unlike a bad
    value, its traceback matters to the component's author: the scheduler process logs it at ERROR
    (`serve`), `generate` shows it with RADIXSERVE_DEBUG=1."""


class PluginRefusal(PluginError, ValueError):
    """A component's hook refused what it was given at start-up with a ValueError (the interfaces'
    way to refuse a value, as `QuantMethod.from_config` does; e.g. a weight source's option that does
    not fit the file): one line naming the component, the hook and the layer, with no traceback, like
    every mistake of the user's. Still a ValueError, as the refusal it reports."""


@dataclass(frozen=True)
class ComponentSpec:
    kind: str
    name: str
    ref: str  # "package.module:Class", imported lazily
    distribution: str  # the pip distribution that registered it
    plugin: str  # the entry-point name of that distribution's plugin module
    version: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ()  # empty: any dtype
    priority: int = 0  # higher wins when the runtime picks a default for a device
    capabilities: tuple[str, ...] = ()
    description: str = ""
    # the weight-source role (quantization components only): checkpoint files with these suffixes
    # are read by this component, found by file type rather than by name (see WeightSource)
    weight_file_suffixes: tuple[str, ...] = ()

    def supports_device(self, device: str) -> bool:
        return device.split(":")[0] in self.devices

    @property
    def is_weight_source(self) -> bool:
        return bool(self.weight_file_suffixes)

    def reads_file(self, path: str) -> bool:
        return path.lower().endswith(self.weight_file_suffixes) if self.weight_file_suffixes else False


@dataclass
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str
    api: str


class ComponentRegistrar:
    """Handed to a plugin's `radixserve_register` hook, bound to that plugin's distribution."""

    def __init__(self, registry: Registry, plugin: PluginInfo) -> None:
        self._registry = registry
        self._plugin = plugin

    def register(
        self,
        kind: str,
        name: str,
        ref: str,
        *,
        devices: tuple[str, ...] | list[str] = ("cpu", "cuda"),
        dtypes: tuple[str, ...] | list[str] = (),
        priority: int = 0,
        capabilities: tuple[str, ...] | list[str] = (),
        description: str = "",
        weight_file_suffixes: tuple[str, ...] | list[str] = (),
    ) -> None:
        """Declare one component (docs/plugin-authoring.md section 3): `kind` (one of plugins.kinds.KINDS:
        "attention", "model", "quantization", "policy", "prefix_cache", "drafter", ...), the `name` stacks
        select it by, and `ref` "module:Class", imported only when the component is used. `devices`: the
        device types it runs on ("cpu", "cuda"); `dtypes`: the model dtypes it takes (empty: any); `priority`:
        which of several claimants a device default picks (higher first); `capabilities`: the kind's flags
        (contracts.md); `description`: shown by `radixserve plugins`; `weight_file_suffixes`: for a weight
        source, the file types it reads. A bad value is a PluginError naming this plugin."""
        from radixserve.plugins.kinds import KINDS

        if kind not in KINDS:
            raise PluginError(
                f"plugin {self._plugin.name!r} ({self._plugin.distribution}) registers unknown kind {kind!r}; "
                f"valid kinds: {', '.join(KINDS)}"
            )
        if ":" not in ref:
            raise PluginError(f"component {kind}/{name}: reference {ref!r} must look like 'module:Class'")
        suffixes = tuple(str(x).lower() for x in weight_file_suffixes)
        if suffixes and kind != "quantization":
            raise PluginError(f"component {kind}/{name}: only quantization components can be weight sources "
                              "(weight_file_suffixes)")
        if any(not x.startswith(".") for x in suffixes):
            raise PluginError(f"component {kind}/{name}: weight_file_suffixes must look like '.gguf', got {suffixes}")
        self._check_devices(kind, name, devices)
        spec = ComponentSpec(
            kind=kind,
            name=name,
            ref=ref,
            distribution=self._plugin.distribution,
            plugin=self._plugin.name,
            version=self._plugin.version,
            devices=tuple(devices),
            dtypes=tuple(dtypes),
            priority=priority,
            capabilities=tuple(capabilities),
            description=description,
            weight_file_suffixes=suffixes,
        )
        self._registry._add(spec)

    def _check_devices(self, kind: str, name: str, devices: Any) -> None:
        """`devices=` must be a tuple or list of device types the core runs on (audit 37: a bare string
        `"cpu"` was listed as the devices c, p, u; `("CPU",)` was accepted, then refused the stack)."""
        where = (f"plugin {self._plugin.name!r} ({self._plugin.distribution}) registers {kind} {name!r} with "
                 f"devices={devices!r}")
        valid = ", ".join(DEVICE_TYPES)
        if not isinstance(devices, (tuple, list)):
            raise PluginError(f"{where}: devices must be a tuple or list of device types, e.g. ('cpu',) or "
                              f"('cpu', 'cuda') (valid device types: {valid})")
        if not devices:
            raise PluginError(f"{where}: name at least one device type the component runs on ({valid})")
        unknown = [d for d in devices if d not in DEVICE_TYPES]
        if unknown:
            raise PluginError(f"{where}: {', '.join(map(repr, unknown))} is not a device type; valid device types "
                              f"(lowercase, without an index): {valid}")


def component_label(spec: ComponentSpec) -> str:
    """How errors name a registered component: "policy 'lpm' (radixserve-policies 0.1.0)"."""
    return f"{spec.kind} {spec.name!r} ({f'{spec.distribution} {spec.version}'.strip()})"


def _class_name(cls: object) -> str:
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)


def subclass_problem(kind: str, cls: object) -> str | None:
    """"is not a subclass of <the kind's base class>" when `cls` is not one (None when it is): the
    check `Registry.load` applies to every component."""
    from radixserve.interfaces import base_class_of_kind

    base = base_class_of_kind(kind)
    if isinstance(cls, type) and issubclass(cls, base):
        return None
    return f"is not a subclass of {base.__module__}.{base.__name__}"


def class_problem(kind: str, cls: object) -> str | None:
    """Why the core could not build `cls` as a component of `kind`, said after the component's name
    (None when it can): not a subclass of the kind's base class; an abstract class ("does not
    implement order()"); a drafter whose `__init__` does not take the `DrafterInfo` first. The stack
    resolution applies it to the selected policy and drafter before any model loads, and the
    conformance kits to the class they are given, so a kit passes only what the core accepts."""
    problem = subclass_problem(kind, cls)
    if problem is not None:
        return problem
    assert isinstance(cls, type)
    if inspect.isabstract(cls):
        from radixserve.interfaces import base_class_of_kind

        missing = sorted(cls.__abstractmethods__)
        return (f"does not implement {', '.join(f'{m}()' for m in missing)} ({_class_name(cls)} leaves "
                f"{'it' if len(missing) == 1 else 'them'} abstract; {base_class_of_kind(kind).__name__} requires "
                f"{'it' if len(missing) == 1 else 'them'})")
    if kind == "drafter":
        return _drafter_init_problem(cls)
    return None


def _drafter_init_problem(cls: type) -> str | None:
    """A drafter is built as `Drafter(info, **speculative.options)`: its `__init__` must take the
    `DrafterInfo` as its first positional parameter (named `info`, or without a default). Audit 37:
    `__init__(self, k=2)` passed the kit and served, the info landing in `k`."""
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C type): building it will tell
        return None
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.VAR_POSITIONAL)]
    first = positional[0] if positional else None
    if first is not None and (first.kind is inspect.Parameter.VAR_POSITIONAL or first.name == "info"
                              or first.default is inspect.Parameter.empty):
        return None
    where = f"{_class_name(cls)}.__init__{_signature_with_self(cls)}"
    lands = f"the info would land in {first.name!r}" if first is not None else "it has no parameter for it"
    return (f"does not take the DrafterInfo first: the core builds a drafter as Drafter(info, "
            f"**speculative.options), and {where} takes no `info` ({lands}); declare __init__(self, info, ...) "
            "and call super().__init__(info)")


def _signature_with_self(cls: type) -> str:
    try:
        return str(inspect.signature(cls.__init__))
    except (TypeError, ValueError):
        return "(...)"


def _exception_line(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def build_component(spec: ComponentSpec, cls: type, *args: Any, refused: str, **kwargs: Any) -> Any:
    """`cls(*args, **kwargs)`, as the core builds a registered component (`spec`; `kwargs` are the
    user's options), with its errors said one way for every kind:

    - a ValueError (the interfaces' way to refuse an option or a configuration) is a PluginError
      `f"{refused}: {e}"`, the user's to fix, without a traceback; so is a TypeError when options
      were given (a value of the wrong type, or an option a `**options` constructor refuses, as the
      Drafter contract asks) or the arguments do not fit the constructor's signature (its cause is
      kept: RADIXSERVE_DEBUG=1 shows where it came from);
    - any other exception (the component's own bug, a TypeError with no options to blame, a KeyError
      from inside its `__init__`) is a PluginCodeError naming the component, its distribution and
      the exception, e.g. "policy 'x' (radixserve-foo 0.1.0) failed to build: KeyError: 'missing'",
      with the exception as `__cause__` (its traceback: RADIXSERVE_DEBUG=1, or the scheduler's log).
      Audit 37: a TypeError was blamed on `stack.policy_options` when none were set, a KeyError came
      out bare."""
    try:
        return cls(*args, **kwargs)
    except ValueError as e:
        raise PluginError(f"{refused}: {e}") from None
    except Exception as e:
        if isinstance(e, TypeError) and (kwargs or not _binds(cls, args, kwargs)):
            raise PluginError(f"{refused}: {e}") from e
        raise PluginCodeError(f"{component_label(spec)} failed to build: {_exception_line(e)}") from e


def _binds(cls: type, args: tuple, kwargs: dict) -> bool:
    """Whether `args` and `kwargs` fit the signature of `cls(...)` (True when it cannot be read)."""
    try:
        inspect.signature(cls).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a C type)
        return True
    return True


def _disable_hint(plugin: str) -> str:
    """How to get past a plugin that cannot load (every command stops on it until then)."""
    return (f"fix or uninstall it, or disable it: -p no:{plugin}, plugins.disable: [{plugin}] in the stack, or "
            f"{DENY_ENV}={plugin}")


def _check_api(plugin: PluginInfo) -> None:
    try:
        spec = SpecifierSet(plugin.api)
    except InvalidSpecifier as e:
        raise PluginError(f"plugin {plugin.name!r} ({plugin.distribution}) has an invalid PLUGIN_API {plugin.api!r}: {e}") from None
    if Version(PLUGIN_API_VERSION) not in spec:
        # which side is behind decides the advice: a plugin asking for a newer core cannot be fixed
        # by upgrading the plugin
        fix = ("upgrade radixserve (this plugin needs a newer core), or install a release of the plugin built for "
               f"plugin API {PLUGIN_API_VERSION}") if _admits_newer_api(spec) else "upgrade the plugin"
        raise PluginError(
            f"plugin {plugin.name!r} from {plugin.distribution} {plugin.version} was built for RadixServe plugin API "
            f"{plugin.api}, but this core (radixserve) offers plugin API {PLUGIN_API_VERSION}; "
            f"{fix}, or disable it with {DENY_ENV}={plugin.name}"
        )
    major = Version(PLUGIN_API_VERSION).release[0]
    if any(Version(f"{m}.0") in spec for m in range(major + 1, major + 100)):
        # a range open above the core's major would also accept a core whose contracts changed
        raise PluginError(
            f"plugin {plugin.name!r} from {plugin.distribution} {plugin.version} declares PLUGIN_API {plugin.api!r}, "
            f"which also admits plugin API {major + 1} and later (contracts this plugin cannot know); bound it "
            f"below the next major, e.g. PLUGIN_API = '{plugin.api},<{major + 1}', or disable it with "
            f"{DENY_ENV}={plugin.name}"
        )


def _admits_newer_api(spec: SpecifierSet) -> bool:
    """Whether `spec` accepts some plugin-API version above the core's. Probed: the next minors and
    majors, and each bound of `spec` with its next micro, minor and major (so `>=9,<10` is seen as
    asking for a newer core however far ahead its bound is)."""
    core = Version(PLUGIN_API_VERSION)
    major, minor = core.release[0], (core.release + (0,))[1]
    later = [f"{major}.{m}" for m in range(minor + 1, minor + 100)]
    later += [f"{M}.{m}" for M in range(major + 1, major + 5) for m in range(100)]
    for bound in spec:
        try:
            v = Version(bound.version.removesuffix(".*"))
        except InvalidVersion:
            continue
        r = v.release + (0, 0)
        later += [str(v), f"{r[0]}.{r[1]}.{r[2] + 1}", f"{r[0]}.{r[1] + 1}", f"{r[0] + 1}.0"]
    return any(Version(v) > core and Version(v) in spec for v in later)


def _warn_undecorated_hooks(module: ModuleType, plugin: PluginInfo) -> None:
    """pluggy calls only functions marked with @hookimpl: an undecorated radixserve_stats or
    radixserve_add_routes would never run, without a word (radixserve_register runs either way)."""
    for name in _PLUGGY_HOOKS:
        fn = getattr(module, name, None)
        if callable(fn) and getattr(fn, f"{hookspec.PROJECT}_impl", None) is None:
            logger.warning("plugin %r (%s) defines %s without @hookimpl, so it is never called; decorate it with "
                           "@radixserve.plugins.hookimpl", plugin.name, plugin.distribution, name)


def _warn_unknown_names(listed: dict[str, str], entry_points: list, effect: str = "nothing is disabled by it") -> None:
    """A deny- or allow-list entry that names no installed plugin does nothing: say so (a typo, or the
    distribution's name given instead of the plugin's entry-point name)."""
    names = {ep.name for ep in entry_points} | {"core"}  # core: the built-in components, always loaded
    by_distribution = {ep.dist.name: ep.name for ep in entry_points if ep.dist is not None}
    for name, source in sorted(listed.items()):
        if name in names:
            continue
        hint = (f"; {name!r} is the distribution of plugin {by_distribution[name]!r}" if name in by_distribution
                else f"; installed plugins: {', '.join(sorted(names - {'core'})) or 'none'}")
        logger.warning("%s names %r, which is no installed plugin: %s%s", source, name, effect, hint)


def _split_env(name: str) -> set[str]:
    return {p.strip() for p in os.environ.get(name, "").split(",") if p.strip()}


class Registry:
    """All components known to this process. Each process builds its own once, at its entry point,
    with `Registry.from_config(config)` (honours the stack's `plugins` section) and passes it down;
    there is no process-wide registry. `Registry.discover()` builds one without a config (tests)."""

    def __init__(self, prefer: dict[str, str] | None = None) -> None:
        # prefer: {"kind/name": distribution} resolves a (kind, name) registered by two distributions
        self.prefer = dict(prefer or {})
        self.plugins: dict[str, PluginInfo] = {}
        self._components: dict[tuple[str, str], ComponentSpec] = {}
        self._conflicts: dict[tuple[str, str], list[ComponentSpec]] = {}
        # installed plugins not loaded: entry-point name -> (distribution, why); named in lookup errors
        self.skipped: dict[str, tuple[str, str]] = {}
        # with discover(keep_going=True): plugins that failed to load -> (distribution, the error)
        self.broken: dict[str, tuple[str, str]] = {}
        # "kind/name" -> why: registered by two distributions and not settled (keep_going only)
        self.conflicts: dict[str, str] = {}
        self.pm = pluggy.PluginManager(hookspec.PROJECT)
        self.pm.add_hookspecs(hookspec)

    # ---- discovery ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Any, *, warn_unknown: bool = True) -> Registry:
        """The registry for a `Config`: plugins named in `plugins.disable` are not loaded and
        `plugins.prefer` settles (kind, name) conflicts. Every process that runs components (the
        CLI, the Engine/HTTP process, the scheduler process) builds its own from the same config;
        `warn_unknown=False` in the runtime's children, whose parent already warned of a list entry
        that names no installed plugin."""
        return cls.discover(deny=set(config.plugins.disable), prefer=dict(config.plugins.prefer),
                            warn_unknown=warn_unknown)

    @classmethod
    def discover(
        cls,
        *,
        allow: set[str] | None = None,
        deny: set[str] | None = None,
        prefer: dict[str, str] | None = None,
        keep_going: bool = False,
        warn_unknown: bool = True,
    ) -> Registry:
        """Load every plugin in the entry-point group, honouring the allow/deny lists
        (arguments, else the RADIXSERVE_PLUGINS / RADIXSERVE_DISABLE_PLUGINS variables). A plugin that
        fails to load (import, PLUGIN_API, its radixserve_register) is a PluginError naming it; with
        `keep_going` (`radixserve plugins`, a diagnostic) it is left out and recorded in `broken`."""
        reg = cls(prefer=prefer)
        allow_source = "the allow-list" if allow is not None else ALLOW_ENV
        allow = allow if allow is not None else _split_env(ALLOW_ENV)
        denied = {name: "plugins.disable" for name in deny or ()}
        denied.update({name: DENY_ENV for name in _split_env(DENY_ENV) - set(denied)})
        reg.add_builtin()
        entry_points = sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        if warn_unknown:
            _warn_unknown_names(denied, entry_points)
            _warn_unknown_names(dict.fromkeys(allow, allow_source), entry_points, "nothing is loaded by it")
        for ep in entry_points:
            dist = ep.dist.name if ep.dist is not None else "?"
            if ep.name in denied or (allow and ep.name not in allow):
                reg.skipped[ep.name] = (dist, denied.get(ep.name) or f"not in {allow_source} {','.join(sorted(allow))}")
                continue
            version = ep.dist.version if ep.dist is not None else ""
            try:
                try:
                    module = ep.load()
                except Exception as e:  # a broken plugin must name itself, not crash with a bare trace
                    raise PluginError(f"plugin {ep.name!r} from {dist} failed to import ({ep.value}): {e!r}; "
                                      f"{_disable_hint(ep.name)}") from e
                reg.add_plugin_module(module, name=ep.name, distribution=dist, version=version)
            except Exception as e:
                if not keep_going:
                    raise
                reg.broken[ep.name] = (dist, str(e) if isinstance(e, PluginError) else f"{type(e).__name__}: {e}")
                reg._forget(ep.name)
        reg.check_conflicts(keep_going=keep_going)
        return reg

    def add_builtin(self) -> None:
        from radixserve import builtin_components

        self.add_plugin_module(builtin_components, name="core", distribution="radixserve", version=_core_version())

    def add_plugin_module(self, module: ModuleType, *, name: str, distribution: str, version: str = "") -> None:
        api = getattr(module, "PLUGIN_API", None)
        # an empty (or blank) specifier set admits every version: it declares nothing, like none at all
        if api is None or (isinstance(api, str) and not api.strip()):
            declared = "does not declare PLUGIN_API" if api is None else f"declares an empty PLUGIN_API ({api!r})"
            raise PluginError(
                f"plugin {name!r} from {distribution} {declared} (e.g. PLUGIN_API = '>=1,<2')"
            )
        info = PluginInfo(name=name, distribution=distribution, version=version, module=module.__name__, api=str(api))
        _check_api(info)
        self.plugins[name] = info
        self.pm.register(module, name=name)
        _warn_undecorated_hooks(module, info)
        impl = getattr(module, "radixserve_register", None)
        if impl is None:
            return
        try:
            impl(registry=ComponentRegistrar(self, info))
        except PluginError:
            raise  # the registrar's own refusal (unknown kind, bad devices, ...): it names the plugin
        except Exception as e:  # audit 37: a raising hook was a bare traceback (exit 1) from every command
            raise PluginError(
                f"plugin {name!r} from {distribution}{f' {version}' if version else ''} failed in radixserve_register: "
                f"{_exception_line(e)}" + ("" if name == "core" else f"; {_disable_hint(name)}")
            ) from e

    def _forget(self, plugin: str) -> None:
        """Drop what a plugin that failed midway had registered (keep_going)."""
        self.plugins.pop(plugin, None)
        if self.pm.has_plugin(plugin):
            self.pm.unregister(name=plugin)
        self._components = {k: s for k, s in self._components.items() if s.plugin != plugin}
        for key, specs in list(self._conflicts.items()):
            kept = [s for s in specs if s.plugin != plugin]
            if len(kept) > 1:
                self._conflicts[key] = kept
            else:
                del self._conflicts[key]
                if kept:
                    self._components[key] = kept[0]

    def _add(self, spec: ComponentSpec) -> None:
        key = (spec.kind, spec.name)
        old = self._components.get(key)
        if old is None:
            self._components[key] = spec
            return
        if old.distribution == spec.distribution:
            raise PluginError(f"{spec.distribution} registers {spec.kind} {spec.name!r} twice")
        self._conflicts.setdefault(key, [old]).append(spec)

    def check_conflicts(self, keep_going: bool = False) -> None:
        """Settle each (kind, name) that two distributions register by `plugins.prefer` (a value names
        the distribution, or its plugin's entry-point name); an unsettled one is a PluginError naming
        both, or with `keep_going` (`radixserve plugins`) is left out and recorded in `conflicts`.
        A prefer entry that settles nothing is a warning: a typo would otherwise pass unseen."""
        for (kind, name), specs in self._conflicts.items():
            key = f"{kind}/{name}"
            wanted = self.prefer.get(key)
            chosen = [s for s in specs if wanted in (s.distribution, s.plugin)]
            if chosen:
                self._components[(kind, name)] = chosen[0]
                continue
            both = " and ".join(f"{s.distribution} (plugin {s.plugin!r})" for s in sorted(specs, key=lambda s: s.distribution))
            message = (f"{kind} component {name!r} is registered by both {both}; uninstall one, disable one with "
                       f"{DENY_ENV}={specs[-1].plugin} (or plugins.disable, or -p no:{specs[-1].plugin}), or pick one "
                       f"in the stack: plugins.prefer: {{'{key}': '{specs[0].distribution}'}}")
            if wanted is not None:
                message += f" (plugins.prefer names {wanted!r} for it, which is neither)"
            if not keep_going:
                raise PluginError(message)
            self.conflicts[key] = message
            self._components.pop((kind, name), None)
        for key, wanted in self.prefer.items():
            kind, _, name = key.partition("/")
            if (kind, name) in self._conflicts:  # settled by it, or reported above
                continue
            spec = self._components.get((kind, name))
            if spec is None:
                logger.warning("plugins.prefer names %r, which no loaded plugin registers: it chooses nothing "
                               "(keys are 'kind/name', e.g. 'policy/fcfs')", key)
            elif wanted not in (spec.distribution, spec.plugin):
                logger.warning("plugins.prefer names %r for %s, which only %s (plugin %r) registers: it chooses "
                               "nothing", wanted, key, spec.distribution, spec.plugin)

    # ---- queries --------------------------------------------------------------------------
    def components(self, kind: str | None = None) -> list[ComponentSpec]:
        return sorted(
            (s for s in self._components.values() if kind is None or s.kind == kind),
            key=lambda s: (s.kind, -s.priority, s.name),
        )

    def names(self, kind: str) -> list[str]:
        return [s.name for s in self.components(kind)]

    def get(self, kind: str, name: str) -> ComponentSpec:
        spec = self._components.get((kind, name))
        if spec is None:
            from radixserve.plugins.known import install_hint

            installed = ", ".join(self.names(kind)) or "none"
            hint = install_hint(kind, name)
            if hint in {dist for dist, _ in self.skipped.values()}:
                hint = None  # installed, only not loaded: the skipped list below says why
            where = "is loaded" if self.skipped else "is installed"
            raise PluginError(
                f"no {kind} component named {name!r} {where}; {'loaded' if self.skipped else 'installed'} {kind} "
                f"components: {installed}" + (f"; {name!r} is provided by {hint} (pip install {hint})" if hint else "")
                + self._skipped_note()
            )
        return spec

    def _skipped_note(self) -> str:
        """'; installed plugins not loaded: ...' grouped by reason, or '' when every plugin loaded."""
        by_reason: dict[str, list[str]] = {}
        for plugin, (dist, why) in sorted(self.skipped.items()):  # the distribution where few are named
            by_reason.setdefault(why, []).append(plugin if why.startswith("not in") else f"{plugin} of {dist}")
        parts = [f"{', '.join(plugins)} ({why})" for why, plugins in by_reason.items()]
        return f"; installed plugins not loaded: {'; '.join(parts)}" if parts else ""

    def load(self, kind: str, name: str) -> Any:
        """Import and return the component class (checked against its kind's base class)."""
        spec = self.get(kind, name)
        module_name, _, attr = spec.ref.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise PluginError(f"{kind} {name!r} from {spec.distribution}: cannot import {spec.ref}: {e}") from e
        problem = subclass_problem(kind, obj)
        if problem is not None:
            raise PluginError(f"{kind} {name!r} ({spec.ref}) {problem}")
        if spec.is_weight_source:
            from radixserve.interfaces.quantization import WeightSource

            if not issubclass(obj, WeightSource):
                raise PluginError(f"{kind} {name!r} ({spec.ref}) declares weight_file_suffixes but is not a "
                                  "subclass of radixserve.interfaces.quantization.WeightSource")
        return obj

    def weight_source_for(self, path: str) -> ComponentSpec | None:
        """The quantization component that declared it reads files like `path` (by suffix)."""
        matches = [s for s in self.components("quantization") if s.reads_file(path)]
        return matches[0] if matches else None

    def weight_source_reading(self, path: str, load_format: str = "auto") -> ComponentSpec | None:
        """The weight source that reads file `path`: the one `load_format` (model.load_format) names, whatever the
        file's suffix (a PluginError if no installed source has that name), else the one that declared the suffix;
        None where none did."""
        if load_format in BUILTIN_LOAD_FORMATS:
            return self.weight_source_for(path)
        return self.weight_source_named(load_format)

    def weight_source_named(self, name: str) -> ComponentSpec:
        """The weight source (a quantization component declaring weight_file_suffixes) called `name`, for
        model.load_format; a PluginError naming the installed ones otherwise."""
        spec = self._components.get(("quantization", name))
        if spec is None or not spec.is_weight_source:
            sources = [s.name for s in self.components("quantization") if s.is_weight_source]
            raise PluginError(f"model.load_format={name!r}: not auto, safetensors, dummy or an installed weight source "
                              f"(installed weight sources: {', '.join(sources) or 'none'})")
        return spec

    def weight_file_suffixes(self) -> list[str]:
        return sorted({x for s in self.components("quantization") for x in s.weight_file_suffixes})

    def default(self, kind: str, device: str) -> ComponentSpec | None:
        """The highest-priority component of `kind` that declares support for `device`."""
        for spec in self.components(kind):
            if spec.supports_device(device):
                return spec
        return None

    @property
    def hook(self) -> Any:
        return self.pm.hook


def _core_version() -> str:
    from radixserve.version import __version__

    return __version__

