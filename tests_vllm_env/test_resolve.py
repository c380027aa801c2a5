"""Do ``vllm==<release>`` (its CUDA wheel) and ``attn-nvfp4-fusion[fa4]`` resolve together?

pip's own resolver, on metadata only: the project's wheel is built from this checkout (in a temporary copy, so
nothing is written into the repository), then ``pip install --dry-run --report`` resolves for a CUDA Linux target
(x86_64, CPython ``FUSION_PASS_VLLM_ENV_PYTHON``, default 3.12, glibc ``FUSION_PASS_VLLM_ENV_GLIBC``, default 2.35),
whatever machine runs the test. Nothing is installed into the running environment: pip runs from a temporary venv
(created with an up-to-date pip) and installs nothing. ``--use-feature=fast-deps`` reads each wheel's metadata with
HTTP range requests, so torch (0.5 GB) and vLLM (0.25 GB) are not downloaded: a release takes about a minute.

pip evaluates the environment markers of dependencies (``python_version > "3.11"``...) on the interpreter it runs
on, whatever ``--python-version`` says, so the temporary venv is made with a Python of the target's version:
``FUSION_PASS_VLLM_ENV_INTERPRETER``, else ``python<version>`` on ``PATH``, else a pyenv install of it; if none is
found the running interpreter is used and every result line says so.

Per release (``FUSION_PASS_VLLM_RELEASES``, comma-separated, default ``0.34.0``; all resolved side by side):

1. Does ``vllm==<release>`` resolve by itself? The pair ``vllm==<release>`` + ``attn-nvfp4-fusion[fa4]`` is resolved
   first: if it resolves, so does vLLM alone (the pair's solution less the project is one), and the versions are
   checked (below). If not, ``vllm==<release>`` is resolved alone: if that resolves, the conflict is the project's
   and the test fails with pip's message and the fa4 pins vLLM's own requirements exclude, if any.
2. If vLLM alone does not resolve, every ``==`` pin of its ``Requires-Dist`` (those whose markers hold for the
   target; ``extra == "..."`` ones excluded) is looked up with ``pip index versions`` (same index, target and
   options; yanked releases do not count). A pin the index does not have is *unavailable*; the one pip's error names
   must be among them, and the test fails if there are none (vLLM is then broken some other way, which this test
   cannot see past). Each unavailable pin is relaxed to its nearest published version: the first final release
   after it, else the last one before it. vLLM's ``Requires-Dist`` (read from the release's CUDA wheel METADATA,
   cached by ``tests_vllm_conformance`` under ``~/.cache/attn-nvfp4-fusion/vllm-wheels``; if it is not cached, from
   pip's ``--no-deps`` dry-run report, which does not download the wheel), so relaxed and with markers evaluated
   for the target, is then resolved beside ``attn-nvfp4-fusion[fa4]``, and alone.

   * both resolve: the versions are checked (below) and the test passes, saying (printed, ``-s``; the
     ``vllm_env`` property of the test; this folder's terminal summary) that vLLM is not installable from the
     index by itself, which pins were relaxed to what, and what then resolves;
   * only vLLM's relaxed requirements resolve: the conflict is the project's, the test fails with pip's message;
   * neither resolves: the test fails, saying that the project's pins could not be checked for that release.

Checked: the resolved ``nvidia-cutlass-dsl`` (and its ``-libs-*`` packages) and ``flash-attn-4`` are the versions the
``fa4`` extra in ``pyproject.toml`` pins; ``torch`` is the version vLLM pins (its relaxed version, if relaxed).

``test_a_conflicting_pin_fails`` shows the check can fail: it builds the project's wheel with ``nvidia-cutlass-dsl``
pinned to 4.8.1 (which no supported vLLM pins) and expects the check of the last release in the list to fail as the
project's conflict, naming that pin.

Every check (each release's, and the conflicting one) runs in a thread of its own from the start, and pip's runs
are shared between them (the same resolution runs once), so all resolutions overlap: the run takes about as long
as its slowest chain of resolutions, not their sum.

pip's configuration files (``pip.conf``, and so local indexes or constraints set there) are ignored; set
``FUSION_PASS_VLLM_ENV_PIP_CONFIG=keep`` to use them. ``PIP_INDEX_URL`` and the other ``PIP_*`` variables apply.

Run: ``python -m pytest -q -p no:cacheprovider -s tests_vllm_env`` (needs the network; no GPU).
"""

from __future__ import annotations

import email.parser
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests_vllm_conformance.fetch import cache_dir, cached  # noqa: E402  (the conformance suite's wheel cache)

RELEASES = [r.strip() for r in os.environ.get("FUSION_PASS_VLLM_RELEASES", "0.34.0").split(",") if r.strip()]
PYTHON = os.environ.get("FUSION_PASS_VLLM_ENV_PYTHON", "3.12")
GLIBC = os.environ.get("FUSION_PASS_VLLM_ENV_GLIBC", "2.35")
TIMEOUT_S = 900
PROJECT = "attn-nvfp4-fusion"
CONFLICT = ("nvidia-cutlass-dsl", "4.8.1")
"""The pin ``test_a_conflicting_pin_fails`` puts in the ``fa4`` extra: a published release no supported vLLM pins."""

# The target's environment, for the markers of vLLM's Requires-Dist (``extra`` empty: no extra of vLLM's is asked).
_FULL = PYTHON if PYTHON.count(".") >= 2 else f"{PYTHON}.0"
TARGET_MARKERS = {"python_version": ".".join(PYTHON.split(".")[:2]), "python_full_version": _FULL,
                  "implementation_version": _FULL, "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "platform_machine": "x86_64",
                  "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
                  "platform_release": "", "platform_version": "", "extra": ""}

# What the wheel build needs from the checkout (the rest, .venv* included, stays behind).
SOURCE_SKIP = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     "out", "tests", "tests_*", "bench", "docs", ".ci")


# --- the project's side --------------------------------------------------------------------------------------------

def fa4_pins(pyproject: str | None = None) -> dict[str, str]:
    """``{canonical name: version}`` of the ``fa4`` extra in pyproject.toml (or in the given text of one); every entry
    must be ``==``-pinned."""
    text = pyproject if pyproject is not None else (ROOT / "pyproject.toml").read_text()
    pins = {}
    for line in tomllib.loads(text)["project"]["optional-dependencies"]["fa4"]:
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"the fa4 extra must pin exactly: {line!r}"
        pins[canonicalize_name(req.name)] = specs[0].version
    return pins


def with_pin(pyproject: str, name: str, version: str) -> str:
    """pyproject.toml's text with the ``fa4`` extra's pin of ``name`` set to ``version``."""
    changed, count = re.subn(rf'"{re.escape(name)}==[^"]*"', f'"{name}=={version}"', pyproject)
    assert count == 1, f"pyproject.toml: no single {name}== pin to replace"
    return changed


def build_wheel(pip: list[str], workdir: Path, label: str, pyproject: str | None = None) -> Path:
    """The project's wheel, built from a copy of the checkout (with ``pyproject`` as its pyproject.toml if given)."""
    source, dist = workdir / f"source-{label}", workdir / f"dist-{label}"
    shutil.copytree(ROOT, source, ignore=SOURCE_SKIP)
    if pyproject is not None:
        (source / "pyproject.toml").write_text(pyproject)
    built = run(pip + ["wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist), str(source)])
    assert built.returncode == 0, f"building the project's wheel ({label}) failed:\n{built.stderr}"
    (path,) = dist.glob("attn_nvfp4_fusion-*.whl")
    return path


def project_requirement(wheel: Path) -> str:
    return f"{PROJECT}[fa4] @ {wheel.as_uri()}"


# --- pip -------------------------------------------------------------------------------------------------------------

def target_options() -> list[str]:
    """pip's options for the target: with ``--platform`` pip takes only the tags it is given, so every manylinux
    tag up to the target glibc is listed (vLLM's dependencies ship manylinux_2_17 to manylinux_2_31 wheels)."""
    major, minor = (int(x) for x in GLIBC.split("."))
    assert major == 2 and minor >= 17, f"FUSION_PASS_VLLM_ENV_GLIBC must be 2.17 or newer, got {GLIBC}"
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(minor, 16, -1)] + ["manylinux2014_x86_64"]
    options = ["--python-version", PYTHON, "--only-binary=:all:"]
    for p in platforms:
        options += ["--platform", p]
    return options


def pip_env() -> dict[str, str]:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    if os.environ.get("FUSION_PASS_VLLM_ENV_PIP_CONFIG") != "keep":
        env["PIP_CONFIG_FILE"] = os.devnull
    return env


def pip_message(stderr: str) -> str:
    """pip's error output without its notice that fast-deps is experimental."""
    return "\n".join(line for line in stderr.strip().splitlines() if "fast-deps" not in line)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=pip_env(), timeout=TIMEOUT_S, **kw)


def python_version_of(interpreter: str) -> str | None:
    try:
        done = subprocess.run([interpreter, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def target_interpreter() -> tuple[str, str]:
    """A Python of the target's version for the temporary venv, and the version of the one returned (the running
    interpreter's when none is found; ``FUSION_PASS_VLLM_ENV_INTERPRETER`` must be of the target's version)."""
    wanted = TARGET_MARKERS["python_version"]
    explicit = os.environ.get("FUSION_PASS_VLLM_ENV_INTERPRETER")
    if explicit:
        found = python_version_of(explicit)
        assert found == wanted, f"FUSION_PASS_VLLM_ENV_INTERPRETER={explicit} is Python {found}, not {wanted}"
        return explicit, found
    pyenv = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates = [shutil.which(f"python{wanted}"),
                  *sorted(glob.glob(f"{pyenv}/versions/{wanted}.*/bin/python{wanted}"), reverse=True)]
    for candidate in filter(None, candidates):
        if python_version_of(candidate) == wanted:
            return candidate, wanted
    return sys.executable, "%d.%d" % sys.version_info[:2]


@dataclass
class Resolution:
    """One ``pip install --dry-run --report``: ``ok``, pip's message (``""`` when it resolved), the resolved
    ``{canonical name: version}``, the report's entries by name, and how long it took."""

    ok: bool
    message: str
    seconds: float
    versions: dict[str, str] = field(default_factory=dict)
    installed: dict[str, dict] = field(default_factory=dict)


class Pip:
    """pip of a temporary venv; resolutions are started in the background and kept by their requirements, so the
    same resolution is run once per session and resolutions started together run side by side."""

    def __init__(self, command: list[str], python: str, workdir: Path):
        self.command, self.python, self.workdir = command, python, workdir
        self._started: dict[tuple[str, ...], tuple[subprocess.Popen, Path, float]] = {}
        self._done: dict[tuple[str, ...], Resolution] = {}
        self._listed: dict[str, list[str] | str] = {}
        self._lock = threading.Lock()  # checks run in threads (see ``checks``)
        self._waits: dict[tuple[str, ...], threading.Lock] = {}
        self._listing = threading.Lock()

    def start(self, *requirements: str, no_deps: bool = False) -> tuple[str, ...]:
        key = (("--no-deps",) if no_deps else ()) + requirements
        with self._lock:
            if key in self._started:
                return key
            report = self.workdir / f"report-{hashlib.sha1(repr(key).encode()).hexdigest()[:12]}.json"
            cmd = self.command + ["install", "--dry-run", "--ignore-installed", "--quiet", "--use-feature=fast-deps",
                                  "--report", str(report)] + target_options() + list(key)
            process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=pip_env())
            self._started[key] = (process, report, time.monotonic())
            self._waits[key] = threading.Lock()
        return key

    def resolve(self, *requirements: str, no_deps: bool = False) -> Resolution:
        key = self.start(*requirements, no_deps=no_deps)
        with self._waits[key]:
            return self._wait(key)

    def _wait(self, key: tuple[str, ...]) -> Resolution:
        if key not in self._done:
            process, report, started = self._started[key]
            try:
                _, stderr = process.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                pytest.fail(f"pip did not resolve {' '.join(key)} within {TIMEOUT_S} s", pytrace=False)
            seconds = time.monotonic() - started
            if process.returncode != 0:
                self._done[key] = Resolution(False, pip_message(stderr), seconds)
            else:
                installed = {canonicalize_name(item["metadata"]["name"]): item
                             for item in json.loads(report.read_text())["install"]}
                versions = {name: item["metadata"]["version"] for name, item in installed.items()}
                self._done[key] = Resolution(True, "", seconds, versions, installed)
        return self._done[key]

    def index_versions(self, names: list[str]) -> dict[str, list[str] | str]:
        """``pip index versions`` of each name, side by side: ``{name: [versions]}`` (yanked ones left out, an empty
        list when the index has none for the target), or ``{name: "pip's error"}``."""
        with self._listing:
            return self._index_versions(names)

    def _index_versions(self, names: list[str]) -> dict[str, list[str] | str]:
        processes = {name: subprocess.Popen(self.command + ["index", "versions", "--json", "--pre"] + target_options()
                                            + [name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                            env=pip_env()) for name in names if name not in self._listed}
        found = self._listed
        for name, process in processes.items():
            stdout, stderr = process.communicate(timeout=TIMEOUT_S)
            if process.returncode == 0:
                found[name] = json.loads(stdout)["versions"]
            elif "No matching distribution found" in stderr:
                found[name] = []
            else:
                found[name] = f"`pip index versions {name}` failed (exit {process.returncode}):\n{pip_message(stderr)}"
        return {name: found[name] for name in names}

    def kill(self):
        with self._lock:
            processes = [process for process, _, _ in self._started.values()]
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


# --- vLLM's side -----------------------------------------------------------------------------------------------------

def metadata_requires(wheel: Path) -> list[str]:
    """``Requires-Dist`` of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        (member,) = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        text = archive.read(member).decode()
    return email.parser.Parser().parsestr(text, headersonly=True).get_all("Requires-Dist") or []


def vllm_requires(release: str, pip: Pip) -> tuple[list[str], str]:
    """vLLM's ``Requires-Dist`` and where it was read: the cached CUDA wheel of the conformance suite, else the
    wheel pip picks for the target (``--no-deps`` dry-run report: metadata only, nothing downloaded in full)."""
    wheel = cached(release, cache_dir())
    if wheel is not None:
        return metadata_requires(wheel), wheel.name
    alone = pip.resolve(f"vllm=={release}", no_deps=True)
    if not alone.ok:
        pytest.fail(f"vllm=={release}: its metadata cannot be read (no cached wheel in {cache_dir()}, and pip "
                    f"--no-deps fails):\n{alone.message}", pytrace=False)
    return alone.installed["vllm"]["metadata"].get("requires_dist", []), "the index (pip --no-deps report)"


def for_target(requires_dist: list[str]) -> list[Requirement]:
    """The requirements whose markers hold for the target (extras of vLLM's own, ``extra == "zen"``..., do not),
    markers dropped: pip would otherwise evaluate them on the interpreter it runs on."""
    kept = []
    for line in requires_dist:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(dict(TARGET_MARKERS)):
            req.marker = None
            kept.append(req)
    return kept


def exact_pin(req: Requirement) -> str | None:
    """The version of an ``==`` pin (not a ``==x.*`` wildcard), else None."""
    exact = [s.version for s in req.specifier if s.operator == "==" and not s.version.endswith(".*")]
    return exact[0] if exact else None


def pinned(requires_dist: list[str], name: str) -> str | None:
    """The version ``name`` is ``==``-pinned to in a ``Requires-Dist`` list, markers evaluated for the target."""
    for req in for_target(requires_dist):
        if canonicalize_name(req.name) == name and exact_pin(req):
            return exact_pin(req)
    return None


def clashes(release: str, pins: dict[str, str], requirements: list[Requirement]) -> str:
    """Which of the fa4 extra's pins vLLM's own requirements (target-evaluated) exclude, in words."""
    found = [f"the fa4 extra pins {name}=={version}, vllm {release} requires {req}"
             for name, version in pins.items() for req in requirements
             if canonicalize_name(req.name) == name and not req.specifier.contains(version, prereleases=True)]
    return "; ".join(found) or f"no pin of the fa4 extra is excluded by vllm {release}'s own requirements: see pip's " \
                               f"message for the package in between"


def neighbours(pin: str, versions: list[str]) -> tuple[str | None, str | None]:
    """The last version before ``pin`` and the first after it among ``versions``, final releases only (unless the
    pin is a pre-release)."""
    wanted = Version(pin)
    parsed = []
    for v in versions:
        try:
            parsed.append(Version(v))
        except InvalidVersion:
            pass
    if not wanted.is_prerelease:
        parsed = [v for v in parsed if not v.is_prerelease]
    before = max((v for v in parsed if v < wanted), default=None)
    after = min((v for v in parsed if v > wanted), default=None)
    return (str(before) if before else None), (str(after) if after else None)


def failing_requirement(message: str) -> str | None:
    """The requirement pip names in ``No matching distribution found for X==Y``, canonical name and all."""
    found = re.search(r"No matching distribution found for (\S+)", message)
    if not found:
        return None
    try:
        req = Requirement(found.group(1))
    except Exception:
        return None
    return f"{canonicalize_name(req.name)}{req.specifier}"


# --- the check -------------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What held for a release: the line to show, and the properties recorded in the test report."""

    line: str
    properties: dict[str, object]


def check_versions(release: str, what: str, resolved: Resolution, pins: dict[str, str], torch_pin: str | None):
    """The fa4 extra's pins (with the cutlass-dsl libs) and vLLM's torch pin, in what resolved."""
    versions = resolved.versions
    wrong = [f"{name} resolved to {versions.get(name)}, the fa4 extra pins {version}"
             for name, version in pins.items() if versions.get(name) != version]
    if "nvidia-cutlass-dsl" in pins:
        libs = {n: v for n, v in versions.items() if n.startswith("nvidia-cutlass-dsl-libs-")}
        if not libs or set(libs.values()) != {pins["nvidia-cutlass-dsl"]}:
            wrong.append(f"the cutlass-dsl libs resolved to {libs}, not {pins['nvidia-cutlass-dsl']}")
    if torch_pin is None:
        wrong.append(f"vllm=={release} does not pin torch exactly")
    elif versions.get("torch") != torch_pin:
        wrong.append(f"torch resolved to {versions.get('torch')}, vLLM pins {torch_pin}")
    if wrong:
        pytest.fail(f"{what} resolves, but: " + "; ".join(wrong), pytrace=False)


def shown(resolved: Resolution, pins: dict[str, str], first: tuple[str, ...] = ()) -> str:
    names = [*first, *pins, "torch", *sorted(n for n in resolved.versions if n.startswith("nvidia-cutlass-dsl-libs-")),
             "quack-kernels", "flashinfer-python"]
    return ", ".join(f"{n} {resolved.versions[n]}" for n in dict.fromkeys(names) if n in resolved.versions)


def check(release: str, pip: Pip, wheel: Path, pins: dict[str, str]) -> Outcome:
    """Whether ``attn-nvfp4-fusion[fa4]`` (``wheel``, whose fa4 extra pins ``pins``) fits vLLM ``release``; fails
    the running test (``pytest.fail``) when it does not, or when that cannot be told. See the module docstring."""
    ours = project_requirement(wheel)
    target = f"python {PYTHON}, glibc {GLIBC}" + ("" if pip.python == TARGET_MARKERS["python_version"] else
                                                  f"; pip ran on Python {pip.python}, whose markers it used")
    together = pip.resolve(f"vllm=={release}", ours)
    # If the pair resolves, so does vLLM alone (the pair's solution without the project is one); else vLLM alone
    # tells whose the failure is.
    alone = together if together.ok else pip.resolve(f"vllm=={release}")
    if alone.ok:
        if not together.ok:
            requirements = for_target(vllm_requires(release, pip)[0])
            pytest.fail(f"vllm=={release} resolves alone but not with {PROJECT}[fa4] ({target}): the conflict is "
                        f"this project's ({clashes(release, pins, requirements)}):\n{together.message}",
                        pytrace=False)
        torch_pin = pinned(together.installed["vllm"]["metadata"].get("requires_dist", []), "torch")
        check_versions(release, f"vllm=={release} + {PROJECT}[fa4]", together, pins, torch_pin)
        line = (f"vllm {release} + {PROJECT}[fa4] resolve ({len(together.versions)} packages, {target}, "
                f"{together.seconds:.0f} s): {shown(together, pins, ('vllm',))}")
        return Outcome(line, {"vllm_installable": True, "relaxed_pins": "", "vllm_env": line})

    # vLLM alone does not resolve: which of its own == pins does the index not have?
    requires_dist, source = vllm_requires(release, pip)
    requirements = for_target(requires_dist)
    pins_of_vllm = {canonicalize_name(r.name): exact_pin(r) for r in requirements if exact_pin(r)}
    listed = pip.index_versions(sorted(pins_of_vllm))
    errors = [v for v in listed.values() if isinstance(v, str)]
    if errors:
        pytest.fail(f"vllm=={release} alone does not resolve ({target}):\n{alone.message}\n\nand its pins could not "
                    f"all be looked up:\n" + "\n".join(errors), pytrace=False)
    missing = {name: pin for name, pin in pins_of_vllm.items() if pin not in listed[name]}
    named = failing_requirement(alone.message)  # pip names the first it tried; it must be one the index lacks
    if not missing or (named in {f"{n}=={p}" for n, p in pins_of_vllm.items()}
                       and named not in {f"{n}=={p}" for n, p in missing.items()}):
        pytest.fail(f"vllm=={release} alone does not resolve ({target}), and not because the index lacks one of its "
                    f"== pins (all {len(pins_of_vllm)} are there{'' if not missing else ' but ' + ', '.join(missing)}"
                    f"): this project's pins cannot be checked against it.\n{alone.message}", pytrace=False)
    relaxed, said = {}, []
    for name, pin in sorted(missing.items()):
        before, after = neighbours(pin, listed[name])
        if before is None and after is None:
            pytest.fail(f"vllm=={release} pins {name}=={pin}, and the index has no other {name} for the target: "
                        f"this project's pins cannot be checked against it.\n{alone.message}", pytrace=False)
        relaxed[name] = after or before
        around = " and ".join(v for v in (before, after) if v)
        said.append((f"{name}=={pin} not on the index, which has {around} around it", f"{name} at {relaxed[name]}"))
    substituted = [f"{r.name}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}=={relaxed[n]}"
                   if (n := canonicalize_name(r.name)) in relaxed else str(r) for r in requirements]
    pip.start(*substituted, ours)
    pip.start(*substituted)  # needed if the first fails; started now, side by side
    together = pip.resolve(*substituted, ours)
    why = "; ".join(s[0] for s in said)
    relaxed_to = ", ".join(s[1] for s in said)
    if not together.ok:
        theirs = pip.resolve(*substituted)
        if theirs.ok:
            pytest.fail(f"vllm=={release} is not installable from this index by itself ({why}); with "
                        f"{relaxed_to}, its requirements ({len(substituted)}, from {source}) resolve alone but not "
                        f"with {PROJECT}[fa4] ({target}): the conflict is this project's "
                        f"({clashes(release, pins, requirements)}):\n{together.message}",
                        pytrace=False)
        pytest.fail(f"vllm=={release} is not installable from this index by itself ({why}); with {relaxed_to}, its "
                    f"requirements do not resolve even without {PROJECT}[fa4] ({target}), so this project's pins "
                    f"could not be checked against it:\n{theirs.message}", pytrace=False)
    torch_pin = relaxed.get("torch") or pins_of_vllm.get("torch")
    what = f"vllm {release}'s requirements (with {relaxed_to}) + {PROJECT}[fa4]"
    check_versions(release, what, together, pins, torch_pin)
    line = (f"vllm {release}: not installable from this index by itself ({why}); with {relaxed_to}, vllm {release}'s "
            f"requirements + {PROJECT}[fa4] resolve ({len(together.versions)} packages, {target}, "
            f"{together.seconds:.0f} s): {shown(together, pins)}")
    return Outcome(line, {"vllm_installable": False, "vllm_env": line,
                          "relaxed_pins": ", ".join(f"{n}=={missing[n]} -> {v}" for n, v in relaxed.items())})


# --- fixtures and tests --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_env")


@pytest.fixture(scope="module")
def pip(workdir) -> Pip:
    """pip of a temporary venv of the target's Python (see the module docstring), upgraded (fast-deps and
    --report need a recent pip)."""
    interpreter, version = target_interpreter()
    made = run([interpreter, "-m", "venv", str(workdir / "venv")])
    assert made.returncode == 0, f"creating the temporary venv with {interpreter} failed:\n{made.stderr}"
    python = str(workdir / "venv" / "bin" / "python")
    upgraded = run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    assert upgraded.returncode == 0, f"upgrading pip in the temporary venv failed:\n{upgraded.stderr}"
    pip = Pip([python, "-m", "pip"], version, workdir)
    yield pip
    pip.kill()


@pytest.fixture(scope="module")
def wheel(workdir, pip) -> Path:
    """The project's wheel, built from a copy of the checkout (only its metadata is read)."""
    return build_wheel(pip.command, workdir, "project")


@pytest.fixture(scope="module")
def conflicting(workdir, pip) -> tuple[Path, dict[str, str]]:
    """The project's wheel with the fa4 extra's pin of :data:`CONFLICT`, and its pins."""
    pyproject = with_pin((ROOT / "pyproject.toml").read_text(), *CONFLICT)
    return build_wheel(pip.command, workdir, "conflict", pyproject), fa4_pins(pyproject)


@pytest.fixture(scope="module")
def checks(pip, wheel, conflicting) -> dict[tuple[str, str], Future]:
    """Every check, run side by side in threads (each waits on pip, so every release's resolutions overlap):
    ``{("project" | "conflict", release): future of its Outcome}``; a test takes its result, failure included."""
    with ThreadPoolExecutor(max_workers=len(RELEASES) + 1) as pool:
        futures = {("project", release): pool.submit(check, release, pip, wheel, fa4_pins()) for release in RELEASES}
        futures[("conflict", RELEASES[-1])] = pool.submit(check, RELEASES[-1], pip, *conflicting)
        yield futures
        for future in futures.values():
            future.cancel()
        pip.kill()  # a test that failed early leaves resolutions running: stop them rather than wait


@pytest.mark.parametrize("release", RELEASES)
def test_vllm_resolves_with_fa4_extra(release, checks, record_property):
    outcome = checks[("project", release)].result()
    for name, value in outcome.properties.items():
        record_property(name, value)
    print(f"\n{outcome.line}", file=sys.stderr)


@pytest.mark.parametrize("release", RELEASES[-1:])
def test_a_conflicting_pin_fails(release, pip, conflicting, checks):
    _, pins = conflicting
    name, version = CONFLICT
    assert pins[name] == version
    requires_dist, _ = vllm_requires(release, pip)
    assert pinned(requires_dist, name) != version, f"vllm=={release} pins {name}=={version}: pick another CONFLICT"
    with pytest.raises(pytest.fail.Exception) as failed:
        checks[("conflict", release)].result()
    message = str(failed.value)
    assert "the conflict is this project's" in message and f"pins {name}=={version}" in message, message
    print(f"\nvllm {release} with {PROJECT}[fa4] pinning {name}=={version} fails, as it should:\n{message}",
          file=sys.stderr)
