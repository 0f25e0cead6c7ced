"""The deployment files (docker/, docker-compose.yml) and the README's deployment section.

No Docker engine runs here, so the files are checked statically: compose is parsed and
interpolated the way Compose does it, every path it or a Dockerfile names must exist (and
survive the .dockerignore), base images are pinned, the server image never installs torch, and
every `autotune` command line (compose, Dockerfile CMD, README) parses with the real CLI parser.
One test runs the server image's command on loopback with torch made unimportable and runs the
image's health check against it.

The README section is read from README.md; AUTOTUNE_DEPLOY_DOC points at another file (a
draft of the section) instead.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import posixpath
import re
import shlex
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml

from api.settings import Settings
from autotune.cli.main import build_parser
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
COMPOSE_PATH = REPO / "docker-compose.yml"
DEPLOY_DOC = Path(os.environ.get("AUTOTUNE_DEPLOY_DOC", REPO / "README.md"))
DEPLOY_HEADING = "## Deploying"
# What the operator must set for `docker compose up` (the rest has defaults).
REQUIRED_ENV = {
    "AUTOTUNE_CLIENT_TOKENS": "client-token",
    "AUTOTUNE_WORKER_TOKENS": "worker-token",
}
# Distributions the server image must not install: the probe side (torch and what needs it).
PROBE_ONLY = {"torch", "optuna", "nvidia-ml-py", "transformers", "numpy"}
# Modules absent from the server image, made unimportable when its command is run here.
NOT_IN_SERVER_IMAGE = ("torch", "optuna", "numpy", "transformers", "pynvml")


# ---------------------------------------------------------------------------------------------
# Compose interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, $$


class MissingVariable(Exception):
    """A `${VAR:?message}` whose variable is unset (or empty): Compose refuses the file."""


_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_]\w*))"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """`value` (a parsed YAML tree) with every variable substituted as Compose does."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        op, arg = match["op"], match["arg"] or ""
        current = env.get(name)
        unset = current is None or (op is not None and op.startswith(":") and current == "")
        if op is not None and op.endswith("?") and unset:
            raise MissingVariable(f"{name}: {arg}")
        if op is not None and op.endswith("-") and unset:
            return arg
        return current or ""

    return _VARIABLE.sub(substitute, value)


def load_compose(env: Mapping[str, str] = REQUIRED_ENV) -> dict[str, Any]:
    compose: dict[str, Any] = interpolate(yaml.safe_load(COMPOSE_PATH.read_text()), env)
    return compose


def command_of(service: Mapping[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.partition("=")[::2] for item in environment)
    return {str(key): "" if value is None else str(value) for key, value in environment.items()}


# ---------------------------------------------------------------------------------------------
# Static checks; each returns the problems it found, so that it can be shown to find them.


def compose_path_problems(compose: Mapping[str, Any], base: Path) -> list[str]:
    """Build contexts, Dockerfiles and bind-mount sources that do not exist; undeclared volumes."""
    problems = []
    declared_volumes = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        build = service.get("build")
        if build is not None:
            build = {"context": build} if isinstance(build, str) else build
            context = base / build.get("context", ".")
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            if not context.is_dir():
                problems.append(f"{name}: build context {context} is not a directory")
            elif not dockerfile.is_file():
                problems.append(f"{name}: Dockerfile {dockerfile} does not exist")
        for volume in service.get("volumes", []):
            if isinstance(volume, str):
                source, _, rest = volume.partition(":")
                kind = "bind" if source.startswith((".", "/", "~")) else "volume"
                if not rest:  # an anonymous volume: a target only
                    continue
            else:
                kind, source = volume["type"], volume.get("source", "")
            if kind == "bind" and not (base / os.path.expanduser(source)).exists():
                problems.append(f"{name}: bind-mount source {source} does not exist")
            if kind == "volume" and source and source not in declared_volumes:
                problems.append(f"{name}: volume {source} is not declared under volumes:")
    return problems


def image_problems(image: str) -> list[str]:
    """An image reference must pin a version: a digest, or a tag with a number, never latest."""
    if "@sha256:" in image:
        return []
    name, _, tag = image.rpartition(":") if ":" in image.rpartition("/")[2] else (image, "", "")
    if not tag:
        return [f"{image}: no tag (means latest)"]
    if tag == "latest" or not re.search(r"\d", tag):
        return [f"{image}: tag {tag!r} is not a version"]
    return []


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined; comment lines vanish, as in BuildKit."""
    instructions: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        continued = stripped.endswith("\\")
        pending += (stripped[:-1] if continued else stripped) + (" " if continued else "")
        if not continued:
            keyword, _, arguments = pending.partition(" ")
            instructions.append(Instruction(keyword.upper(), arguments.strip()))
            pending = ""
    return instructions


def exec_form(arguments: str) -> list[str]:
    """A JSON-array instruction argument (CMD, HEALTHCHECK CMD); shell form is refused."""
    value = json.loads(arguments)
    assert isinstance(value, list), arguments
    return [str(item) for item in value]


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    starts = [i for i, instruction in enumerate(instructions) if instruction.keyword == "FROM"]
    return instructions[starts[-1] :]


def base_images(instructions: list[Instruction]) -> list[str]:
    """Every FROM's image, `${ARG}` resolved from the ARG defaults declared before it."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    images = []
    for instruction in instructions:
        if instruction.keyword == "ARG" and "=" in instruction.arguments:
            name, _, default = instruction.arguments.partition("=")
            args[name.strip()] = default.strip().strip("\"'")
        elif instruction.keyword == "FROM":
            words = [w for w in instruction.arguments.split() if not w.startswith("--")]
            image = interpolate(words[0], args)
            if len(words) == 3 and words[1].upper() == "AS":
                stages.add(words[2])
            if image not in stages:
                images.append(image)
    return images


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    # Go's filepath.Match plus Docker's `**`: `*` and `?` never cross a `/`, `**` crosses any.
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        else:
            out.append({"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i])))
            i += 1
    return re.compile("".join(out))


def is_ignored(path: str, ignore_text: str) -> bool:
    """Whether .dockerignore rules drop `path` (relative to the context) from the build context.

    As in moby/patternmatcher: a rule matching a parent directory matches the path, `!` rules
    re-include, and the last matching rule wins.
    """
    parts = posixpath.normpath(path).split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for line in ignore_text.splitlines():
        rule = line.strip()
        if not rule or rule.startswith("#"):
            continue
        negated = rule.startswith("!")
        regex = _ignore_regex(posixpath.normpath(rule.lstrip("!").strip()).lstrip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored


def dockerfile_problems(dockerfile: Path, context: Path) -> list[str]:
    """Pinned bases, a non-root final user, and COPY sources that exist and reach the builder."""
    instructions = parse_dockerfile(dockerfile.read_text())
    problems = [p for image in base_images(instructions) for p in image_problems(image)]
    # BuildKit reads <Dockerfile>.dockerignore next to the Dockerfile before the context's own.
    ignore_file = dockerfile.with_name(dockerfile.name + ".dockerignore")
    if not ignore_file.is_file():
        ignore_file = context / ".dockerignore"
    ignore_text = ignore_file.read_text() if ignore_file.is_file() else ""
    for instruction in instructions:
        if instruction.keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(instruction.arguments)
        if any(w.startswith("--from") for w in words):
            continue
        for source in [w for w in words if not w.startswith("--")][:-1]:
            if not list(context.glob(source)):
                problems.append(f"{instruction.keyword} {source}: not in the build context")
            elif is_ignored(source, ignore_text):
                problems.append(f"{instruction.keyword} {source}: excluded by {ignore_file.name}")
    users = [i.arguments for i in final_stage(instructions) if i.keyword == "USER"]
    if not users or users[-1].partition(":")[0] in ("root", "0"):
        problems.append(f"final stage runs as root (USER: {users})")
    return problems


def installed_extras(dockerfile_text: str, extras: set[str]) -> set[str]:
    """Extras a Dockerfile installs: `.[a,b]` requirements and `['a']` lookups in pyproject."""
    found = set()
    for group in re.findall(r"\.\[([\w,\s-]+)\]", dockerfile_text):
        found |= {name.strip() for name in group.split(",")}
    found |= set(re.findall(r"\[['\"]([\w-]+)['\"]\]", dockerfile_text)) & extras
    return found


def distribution_names(requirements: list[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        assert match, requirement
        names.add(re.sub(r"[-_.]+", "-", match[0]).lower())
    return names


def pyproject() -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project


# ---------------------------------------------------------------------------------------------
# The CLI, exactly as a container would run it.


def use_only_env(env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The container's view: no AUTOTUNE_* settings but `env`'s."""
    for name in [n for n in os.environ if n.startswith("AUTOTUNE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def parse_cli(
    argv: list[str], env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch
) -> argparse.Namespace:
    """`argv` (starting with `autotune`) parsed by the real parser under only `env`'s settings."""
    assert argv[0] == "autotune", argv
    use_only_env(env, monkeypatch)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return build_parser().parse_args(argv[1:])
    except SystemExit as exit_:
        pytest.fail(f"`{shlex.join(argv)}` does not parse ({exit_.code}): {errors.getvalue()}")


def dockerfile_env(instructions: list[Instruction]) -> dict[str, str]:
    env = {}
    for instruction in final_stage(instructions):
        if instruction.keyword == "ENV":
            for word in shlex.split(instruction.arguments):
                name, _, value = word.partition("=")
                env[name] = value
    return env


def deploy_section() -> str:
    text = DEPLOY_DOC.read_text()
    start = text.find(DEPLOY_HEADING)
    if start < 0:
        pytest.fail(f"{DEPLOY_DOC} has no {DEPLOY_HEADING!r} section")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def shell_commands(markdown: str) -> Iterator[str]:
    """Each command line of the ```sh blocks, continuation lines joined."""
    for block in re.findall(r"```sh\n(.*?)```", markdown, flags=re.DOTALL):
        for command in re.sub(r"\\\n\s*", " ", block).splitlines():
            if command.strip():
                yield command.strip()


# ---------------------------------------------------------------------------------------------
# The checks are able to fail


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    cases = {
        "${SET}": "x",
        "$SET/y": "x/y",
        "${UNSET}": "",
        "${UNSET:-d}": "d",
        "${EMPTY:-d}": "d",
        "${EMPTY-d}": "",
        "${SET:?gone}": "x",
        "cost $$5": "cost $5",
    }
    assert {text: interpolate(text, env) for text in cases} == cases
    with pytest.raises(MissingVariable, match="EMPTY: set it"):
        interpolate({"a": ["${EMPTY:?set it}"]}, env)
    with pytest.raises(MissingVariable, match="UNSET"):
        interpolate("${UNSET?}", env)


def test_static_checks_find_broken_files(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "__pycache__").mkdir()
    (tmp_path / "app.Dockerfile").write_text(
        "ARG BASE=python:latest\nFROM ${BASE}\nFROM ubuntu AS build\nFROM build\n"
        "COPY src ./src\nCOPY missing.txt /x\nCOPY --from=build /a /b\nUSER root\n"
    )
    (tmp_path / "app.Dockerfile.dockerignore").write_text("*\n!missing.txt\n")
    assert dockerfile_problems(tmp_path / "app.Dockerfile", tmp_path) == [
        "python:latest: tag 'latest' is not a version",
        "ubuntu: no tag (means latest)",
        "COPY src: excluded by app.Dockerfile.dockerignore",
        "COPY missing.txt: not in the build context",
        "final stage runs as root (USER: ['root'])",
    ]
    compose = {
        "services": {
            "a": {"build": {"context": "nowhere"}, "volumes": ["./gone:/x", "data:/d", "/t"]},
            "b": {"build": ".", "volumes": [{"type": "bind", "source": "./src", "target": "/s"}]},
        },
        "volumes": {},
    }
    assert compose_path_problems(compose, tmp_path) == [
        f"a: build context {tmp_path / 'nowhere'} is not a directory",
        "a: bind-mount source ./gone does not exist",
        "a: volume data is not declared under volumes:",
        f"b: Dockerfile {tmp_path / 'Dockerfile'} does not exist",
    ]
    assert image_problems("postgres:16") == []
    assert image_problems("registry:5000/team/img@sha256:abc") == []
    assert image_problems("registry:5000/team/img") == [
        "registry:5000/team/img: no tag (means latest)"
    ]


def test_dockerignore_rules_match_like_docker() -> None:
    rules = "*\n!autotune/\n**/__pycache__\n!README.md\nREADME*.md\n"
    assert not is_ignored("autotune/cli/main.py", rules)
    assert is_ignored("autotune/sub/__pycache__/x.pyc", rules)
    assert is_ignored(".venv/bin/python", rules)
    assert is_ignored("README.md", rules)  # the last matching rule wins


def test_installed_extras_are_found_in_both_spellings() -> None:
    assert installed_extras('pip install ".[api, probe]"', {"api"}) == {"api", "probe"}
    text = "x = p['optional-dependencies']; x['probe'] + x['hf']"
    assert installed_extras(text, {"probe", "hf", "api"}) == {"probe", "hf"}


# ---------------------------------------------------------------------------------------------
# The real files


def test_compose_files_paths_and_images_exist() -> None:
    compose = load_compose()
    assert compose_path_problems(compose, COMPOSE_PATH.parent) == []
    for name, service in compose["services"].items():
        if "build" not in service:
            assert image_problems(service["image"]) == [], name
    for name in ("server", "worker"):
        build = compose["services"][name]["build"]
        dockerfile = COMPOSE_PATH.parent / build["context"] / build["dockerfile"]
        assert dockerfile_problems(dockerfile, COMPOSE_PATH.parent / build["context"]) == []


def test_compose_services_profiles_and_wiring() -> None:
    services = load_compose()["services"]
    server, worker, postgres = services["server"], services["worker"], services["postgres"]
    assert "profiles" not in server  # `docker compose up` always starts the server
    assert worker["profiles"] == ["gpu"]
    assert postgres["profiles"] == ["postgres"]
    assert postgres["image"].partition(":")[0] == "postgres"
    assert server["depends_on"]["postgres"] == {"condition": "service_healthy", "required": False}
    assert worker["depends_on"]["server"]["condition"] == "service_healthy"
    (gpu,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia"
    assert gpu["capabilities"] == ["gpu"]
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])


def test_only_always_on_variables_are_required() -> None:
    # Compose interpolates every service before it applies profiles (docker/compose#11977):
    # a `:?` in a profiled service would break `docker compose up` for everyone.
    for name in REQUIRED_ENV:
        with pytest.raises(MissingVariable, match=name):
            load_compose({key: value for key, value in REQUIRED_ENV.items() if key != name})
    raw = yaml.safe_load(COMPOSE_PATH.read_text())
    for name, service in raw["services"].items():
        if "profiles" in service:
            assert "?" not in "".join(re.findall(r"\$\{[^}]*\}", json.dumps(service))), name


def test_server_settings_from_compose_land_in_the_data_volume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = load_compose()["services"]["server"]
    env = service_env(server)
    settings_names = {f"AUTOTUNE_{field.upper()}" for field in Settings.model_fields}
    # uvicorn's own setting (the trusted proxies): the only one that is not autotune's.
    assert env.pop("FORWARDED_ALLOW_IPS") == "127.0.0.1,::1"
    assert set(env) <= settings_names, set(env) - settings_names
    use_only_env(env, monkeypatch)
    settings = Settings()  # read from the environment, as `autotune serve` in the container
    assert settings.client_tokens == ["client-token"]
    assert settings.worker_tokens == ["worker-token"]
    assert not settings.open_reads
    # Unset AUTOTUNE_DATABASE_URL means SQLite, inside the volume mounted at the data dir.
    assert not settings.database_url
    assert f"autotune-data:{settings.data_dir}" in server["volumes"]
    postgres_url = "postgresql+psycopg://autotune:pw@postgres:5432/autotune"
    with_postgres = load_compose({**REQUIRED_ENV, "AUTOTUNE_DATABASE_URL": postgres_url})
    assert service_env(with_postgres["services"]["server"])["AUTOTUNE_DATABASE_URL"] == (
        postgres_url
    )


def test_server_image_never_installs_torch() -> None:
    text = (REPO / "docker" / "server.Dockerfile").read_text()
    project = pyproject()
    extras_table: dict[str, list[str]] = project["optional-dependencies"]
    extras = installed_extras(text, set(extras_table))
    assert extras == {"api"}
    installed = distribution_names(
        project["dependencies"] + [r for extra in extras for r in extras_table[extra]]
    )
    assert not installed & PROBE_ONLY
    for instruction in parse_dockerfile(text):
        if instruction.keyword == "RUN":
            assert not re.search(r"\btorch\b", instruction.arguments), instruction


def test_worker_image_keeps_the_base_images_torch() -> None:
    text = (REPO / "docker" / "worker.Dockerfile").read_text()
    instructions = parse_dockerfile(text)
    (base,) = base_images(instructions)
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda[\d.]+-cudnn\d+-runtime", base)
    extras = installed_extras(text, set(pyproject()["optional-dependencies"]))
    assert {"probe", "hf"} <= extras
    assert "api" not in extras
    installs = [
        shlex.split(command)
        for i in instructions
        if i.keyword == "RUN"
        for command in i.arguments.split("&&")
        if "pip install" in command
    ]
    assert installs
    for words in installs:
        # Every install is held to the torch already in the image, and names no torch itself.
        assert "-c" in words, words
        assert not any(re.match(r"torch\b", w) for w in words), words


def test_server_command_healthcheck_and_ports_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    server = load_compose()["services"]["server"]
    instructions = parse_dockerfile((REPO / "docker" / "server.Dockerfile").read_text())
    image_cmd = exec_form(next(i for i in instructions if i.keyword == "CMD").arguments)
    assert command_of(server) == image_cmd
    args = parse_cli(command_of(server), service_env(server), monkeypatch)
    assert (args.command, args.host) == ("serve", "0.0.0.0")
    assert f"{args.port}" == server["ports"][0].rpartition(":")[2]
    assert [i.arguments for i in instructions if i.keyword == "EXPOSE"] == [str(args.port)]
    (healthcheck,) = [i.arguments for i in instructions if i.keyword == "HEALTHCHECK"]
    image_test = exec_form(healthcheck[healthcheck.index("CMD ") + 4 :])
    assert server["healthcheck"]["test"] == ["CMD", *image_test]
    assert f"http://127.0.0.1:{args.port}/health" in image_test[-1]


def test_worker_commands_parse_as_the_worker_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = load_compose()["services"]["worker"]
    args = parse_cli(command_of(worker), service_env(worker), monkeypatch)
    assert (args.command, args.server, args.device) == ("worker", "http://server:8000", "cuda:0")
    # The compose settings reach the worker: its token through AUTOTUNE_TOKEN, its GPU index.
    chosen = {**REQUIRED_ENV, "AUTOTUNE_WORKER_TOKEN": "gpu-box-token", "AUTOTUNE_GPU": "3"}
    worker = load_compose(chosen)["services"]["worker"]
    args = parse_cli(command_of(worker), service_env(worker), monkeypatch)
    assert (args.token, args.device) == ("gpu-box-token", "cuda:3")
    # The image's default command, with the server and token from the environment.
    instructions = parse_dockerfile((REPO / "docker" / "worker.Dockerfile").read_text())
    image_cmd = exec_form(next(i for i in instructions if i.keyword == "CMD").arguments)
    env = {
        **dockerfile_env(instructions),
        "AUTOTUNE_SERVER": "http://server:8000",
        "AUTOTUNE_TOKEN": "worker-token",
    }
    args = parse_cli(image_cmd, env, monkeypatch)
    assert (args.command, args.server, args.token) == (
        "worker",
        env["AUTOTUNE_SERVER"],
        "worker-token",
    )


def test_readme_documents_the_compose_worker_command(monkeypatch: pytest.MonkeyPatch) -> None:
    section = deploy_section()
    compose = load_compose()
    commands = list(shell_commands(section))
    assert shlex.join(command_of(compose["services"]["worker"])) in commands
    # Every autotune command the section shows is one the CLI accepts.
    shown = [shlex.split(c) for c in commands if c.startswith("autotune ") or " autotune " in c]
    cli_lines = [words[words.index("autotune") :] for words in shown]
    assert {words[1] for words in cli_lines} >= {"worker", "submit"}
    for words in cli_lines:
        parse_cli(words, {}, monkeypatch)
    # ... and so is every profile, Dockerfile and image it names.
    profiles = {p for s in compose["services"].values() for p in s.get("profiles", [])}
    named = set(re.findall(r"--profile (\w+)", section))
    for setting in re.findall(r"COMPOSE_PROFILES=([\w,]+)", section):
        named |= set(setting.split(","))
    assert named and named <= profiles
    for path in set(re.findall(r"docker/[\w.]+\.Dockerfile", section)):
        assert (REPO / path).is_file(), path
    worker_base = base_images(
        parse_dockerfile((REPO / "docker" / "worker.Dockerfile").read_text())
    )
    assert worker_base[0] in section


# ---------------------------------------------------------------------------------------------
# The server image's command, run for real (without torch), and its health check


_SERVER_IMAGE_PYTHON = """
import sys

class NotInTheImage:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in the image)", name=name)
        return None

sys.meta_path.insert(0, NotInTheImage())
from autotune.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _run_healthcheck(test: list[str], port: int) -> int:
    assert test[:2] == ["CMD", "python"], test
    argv = [sys.executable, *test[2:]]
    argv[-1] = argv[-1].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    return subprocess.run(argv, capture_output=True, timeout=30).returncode


def test_server_command_serves_without_torch_and_passes_its_healthcheck(tmp_path: Path) -> None:
    server = load_compose()["services"]["server"]
    argv = command_of(server)
    port = free_port()
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    env |= service_env(server) | {"AUTOTUNE_DATA_DIR": str(tmp_path / "data")}
    log_path = tmp_path / "server.log"
    code = _SERVER_IMAGE_PYTHON.format(blocked=NOT_IN_SERVER_IMAGE)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", code, *argv[1:]], env=env, stdout=log, stderr=log, cwd=tmp_path
        )
    try:
        deadline = time.monotonic() + 30
        while _run_healthcheck(server["healthcheck"]["test"], port) != 0:
            assert process.poll() is None, f"server exited:\n{log_path.read_text()}"
            if time.monotonic() > deadline:
                pytest.fail(f"the health check never passed; server log:\n{log_path.read_text()}")
            time.sleep(0.1)
        # The tokens came from the compose environment, so none were generated, and the
        # SQLite database sits in the data directory (the volume).
        assert "generated" not in log_path.read_text()
        assert (tmp_path / "data" / "autotune.db").is_file()
        # The web pages too, from the image's installed package and without torch.
        page = httpx2.get(f"http://127.0.0.1:{port}/", timeout=10)
        assert page.status_code == 401 and 'name="token"' in page.text  # asks for the token
        assert httpx2.get(f"http://127.0.0.1:{port}/static/autotune.js", timeout=10).is_success
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert _run_healthcheck(server["healthcheck"]["test"], port) != 0
