"""compose.yaml keeps what the docs promise (the Dockerfile: tests/test_dockerfile.py).

The file is parsed with PyYAML and checked against the code it deploys: the worker's environment must parse as `pagestream worker` flags, the health
check must be a real command, the drain must fit in Docker's stop grace period. Where a Docker
Compose v2 is installed, `docker compose config` validates the file against the Compose spec.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from commands import build_parser
from tests.test_dockerfile import parse_dockerfile
from worker.env_flags import ENV_PREFIX, env_var, flag_actions
from worker.settings import DEFAULT_GRACE_S

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_PATH = ROOT / "compose.yaml"
DOCKERFILE_PATH = ROOT / "Dockerfile"
DOCKERIGNORE_PATH = ROOT / ".dockerignore"

PACKAGES = ("engine", "kernels", "worker", "clients")  # what `pip install .` needs in the image
MIN_START_PERIOD_S = 300  # a model download, its load and the CUDA-graph capture
OBSERVABILITY = "observability"
OPTIONAL_PROFILES = ("observability", "multi-gpu", "tp2", "cluster")
CLUSTER = "cluster"  # the profile of the Redis Cluster deployment, started by its gateway's name
CLUSTER_GATEWAY = "gateway-cluster"
CLUSTER_CREATE = "redis-cluster-create"
TENSOR_PARALLEL_VAR = "PAGESTREAM_TENSOR_PARALLEL_SIZE"
COMPOSE_TIMEOUT_S = 30


# -- Compose helpers: interpolation and durations ------------------------------------------------

# ${VAR}, ${VAR:-default}, ${VAR-default}, $VAR, and $$ (a literal $), as Compose reads them.
INTERPOLATION = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(text: str, host_env: Mapping[str, str]) -> str:
    """``text`` with its variables replaced from ``host_env`` (the shell compose runs in)."""

    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        value = host_env.get(name)
        op = match["op"]
        if op == ":-" and not value:  # unset or empty
            return str(match["default"])
        if op == "-" and value is None:  # unset only
            return str(match["default"])
        return value or ""

    return INTERPOLATION.sub(replace, text)


DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
DURATION_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration_s(text: str) -> float:
    """A Compose duration ("600s", "10m", "1m30s", "1h") in seconds."""
    parts = DURATION_PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f"not a Compose duration: {text!r}")
    return sum(float(number) * DURATION_UNIT_S[unit] for number, unit in parts)


def test_helpers_read_compose_syntax() -> None:
    host_env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d}/${EMPTY:-d}/${UNSET:-d}", host_env) == "x/d/d"
    assert interpolate("${SET-d}/${EMPTY-d}/${UNSET-d}", host_env) == "x//d"
    assert interpolate("${SET}$SET$${SET}${UNSET}", host_env) == "xx${SET}"
    assert parse_duration_s("1m30s") == 90
    assert parse_duration_s("10m0s") == parse_duration_s("600s") == 600
    with pytest.raises(ValueError):
        parse_duration_s("60")


# -- compose.yaml -------------------------------------------------------------------------------


def load_compose() -> dict[str, Any]:
    compose: dict[str, Any] = yaml.safe_load(COMPOSE_PATH.read_text())
    return compose


def services() -> dict[str, dict[str, Any]]:
    return dict(load_compose()["services"])


def worker_services() -> dict[str, dict[str, Any]]:
    """The services made from the `x-worker` template (YAML merge copies its keys into them;
    one may add variables to the template's environment, as the tensor-parallel one does, or
    wait for another Redis, as the cluster profile's does)."""
    compose = load_compose()
    template: dict[str, Any] = compose["x-worker"]

    def made_from_template(service: dict[str, Any]) -> bool:
        for key, value in template.items():
            if key == "depends_on":  # test_workers_wait_for_redis_and_check_their_own_health
                continue
            if key == "environment":
                if not as_mapping(value).keys() <= as_mapping(service.get(key)).keys():
                    return False
            elif service.get(key) != value:
                return False
        return True

    return {
        name: service
        for name, service in compose["services"].items()
        if made_from_template(service)
    }


def as_mapping(environment: Any) -> dict[str, str]:
    """A service's `environment`, in either of its Compose forms (mapping or KEY=VALUE list)."""
    if environment is None:
        return {}
    if isinstance(environment, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in environment)
    return {key: "" if value is None else str(value) for key, value in environment.items()}


def container_env(service: dict[str, Any], host_env: Mapping[str, str]) -> dict[str, str]:
    """What the container sees when compose runs in a shell with ``host_env``."""
    return {
        key: interpolate(value, host_env)
        for key, value in as_mapping(service.get("environment")).items()
    }


@dataclass
class Mount:
    source: str
    target: str
    is_named_volume: bool


def mounts(service: dict[str, Any]) -> list[Mount]:
    """A service's volumes, short ("src:target[:mode]") or long syntax, variables at defaults."""
    found = []
    for entry in service.get("volumes", []):
        if isinstance(entry, str):
            source, target = interpolate(entry, {}).split(":")[:2]
        else:
            source, target = interpolate(str(entry["source"]), {}), str(entry["target"])
        is_path = source.startswith(("/", ".", "~"))
        found.append(Mount(source, target, is_named_volume=not is_path))
    return found


def command_words(value: Any) -> list[str]:
    return list(map(str, value)) if isinstance(value, list) else shlex.split(str(value))


def healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        return shlex.split(test)
    kind, *rest = test
    return shlex.split(rest[0]) if kind == "CMD-SHELL" else list(rest)


def test_redis_persists_its_queue_and_reports_health() -> None:
    compose = load_compose()
    redis = compose["services"]["redis"]
    words = command_words(redis["command"])
    assert "--appendonly" in words and words[words.index("--appendonly") + 1] == "yes"
    data = [mount for mount in mounts(redis) if mount.target == "/data"]
    assert len(data) == 1 and data[0].is_named_volume, "Redis's /data needs a named volume"
    assert data[0].source in compose["volumes"]
    argv = healthcheck_argv(redis)
    assert argv[0] == "redis-cli" and "ping" in argv
    assert "PONG" in argv, "redis-cli exits 0 on NOAUTH: the check must look for PONG"
    # no password: published on loopback only
    for port in redis.get("ports", []):
        assert str(port).startswith("127.0.0.1:"), f"Redis port {port} is open beyond this host"


def test_workers_share_one_template_and_differ_only_in_gpu() -> None:
    workers = worker_services()
    assert {"worker-0", "worker-1"} <= workers.keys()
    built = {name for name, service in services().items() if "build" in service}
    assert built <= workers.keys(), f"{built - workers.keys()} build the image but skip x-worker"
    allowed_differences = {"deploy", "profiles"}
    first, second = workers["worker-0"], workers["worker-1"]
    for key in (first.keys() | second.keys()) - allowed_differences:
        assert first.get(key) == second.get(key), f"worker-0 and worker-1 differ in {key}"
    assert "profiles" not in first, "worker-0 must start with a plain `docker compose up`"


def test_workers_wait_for_redis_and_check_their_own_health() -> None:
    for name, worker in worker_services().items():
        if CLUSTER in worker.get("profiles", []):  # the cluster, once created
            condition = worker["depends_on"][CLUSTER_CREATE]["condition"]
            assert condition == "service_completed_successfully", name
        else:
            assert worker["depends_on"]["redis"]["condition"] == "service_healthy", name
        argv = healthcheck_argv(worker)
        assert argv[:2] == ["pagestream", "health"], name
        build_parser().parse_args(argv[1:])  # a valid command, not just a string
        start_period_s = parse_duration_s(worker["healthcheck"]["start_period"])
        assert start_period_s >= MIN_START_PERIOD_S, name
        assert worker["init"] is True, f"{name}: SIGTERM must reach the worker during loading"


def test_stop_grace_period_outlasts_the_drain() -> None:
    for name, worker in worker_services().items():
        grace = container_env(worker, {}).get(f"{ENV_PREFIX}GRACE_S") or DEFAULT_GRACE_S
        stop_grace_s = parse_duration_s(worker["stop_grace_period"])
        assert stop_grace_s > float(grace), f"{name}: Docker would SIGKILL a draining worker"


def gpu_device_ids(worker: dict[str, Any]) -> list[str]:
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d["capabilities"]]
    assert len(gpus) == 1, "one NVIDIA GPU reservation per worker"
    assert "count" not in gpus[0], "device_ids, not count: each worker gets its own GPU"
    return [str(device_id) for device_id in gpus[0]["device_ids"]]


def test_each_worker_reserves_its_own_gpus() -> None:
    """One GPU per worker, or one per rank of a tensor-parallel worker; none twice among the
    workers of one deployment (the cluster profile's run instead of the default ones)."""
    device_ids = {name: gpu_device_ids(worker) for name, worker in worker_services().items()}
    for name, worker in worker_services().items():
        num_ranks = int(container_env(worker, {}).get(TENSOR_PARALLEL_VAR) or 1)
        assert len(device_ids[name]) == num_ranks, f"{name}: a GPU per rank, {device_ids}"
    for on_cluster in (False, True):
        deployment = {
            name: ids
            for name, ids in device_ids.items()
            if (CLUSTER in worker_services()[name].get("profiles", [])) == on_cluster
        }
        flat = [device_id for ids in deployment.values() for device_id in ids]
        assert len(set(flat)) == len(flat), f"workers share a GPU: {deployment}"


def test_tensor_parallel_worker_is_opt_in_and_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TP=2 example: a profile of its own (a one-GPU host runs `docker compose up`), the
    template's variables plus the TP size, which `pagestream worker` reads as its flag."""
    workers = worker_services()
    groups = {n: w for n, w in workers.items() if TENSOR_PARALLEL_VAR in container_env(w, {})}
    assert "worker-tp2" in groups
    for name, worker in groups.items():
        assert worker.get("profiles"), f"{name} needs several GPUs: it must be opt-in"
        env = container_env(worker, {})
        args = parse_worker_args(monkeypatch, env)
        assert args["tensor_parallel_size"] == len(gpu_device_ids(worker)) >= 2, name
        # Requests name no model: every worker on the stream runs the same one.
        assert env["PAGESTREAM_MODEL"] == container_env(workers["worker-0"], {})["PAGESTREAM_MODEL"]


def test_workers_mount_the_caches_where_the_image_looks() -> None:
    compose = load_compose()
    image = parse_dockerfile(DOCKERFILE_PATH.read_text())
    image_env = image.final_stage.env
    for name, worker in worker_services().items():
        by_target = {mount.target: mount for mount in mounts(worker)}
        cache = by_target.get("/cache")
        assert cache and cache.is_named_volume and cache.source in compose["volumes"], name
        assert "/cache" in image.final_stage.volumes
        hf_cache = by_target.get(image_env["HF_HOME"])
        assert hf_cache and not hf_cache.is_named_volume, f"{name}: host's HF cache not mounted"


# -- the worker's environment against the CLI ---------------------------------------------------


def worker_flag_parser() -> argparse.ArgumentParser:
    """The `pagestream worker` subparser, its lazily added flags in place."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    worker: argparse.ArgumentParser = subparsers.choices["worker"]
    worker.format_help()  # LazyParser adds its flags on first use
    return worker


def env_name_to_option() -> dict[str, str]:
    """PAGESTREAM_SOME_FLAG -> --some-flag, for every flag of `pagestream worker`."""
    return {
        env_var(action): action.option_strings[-1] for action in flag_actions(worker_flag_parser())
    }


def parse_worker_args(
    monkeypatch: pytest.MonkeyPatch, env: Mapping[str, str], flags: list[str] | None = None
) -> dict[str, Any]:
    """`pagestream worker FLAGS` parsed with exactly ``env`` as its PAGESTREAM_* environment."""
    with monkeypatch.context() as patch:
        for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        return vars(build_parser().parse_args(["worker", *(flags or [])]))


def test_every_pagestream_variable_names_a_worker_flag() -> None:
    options = env_name_to_option()
    for name, worker in worker_services().items():
        ours = {key for key in container_env(worker, {}) if key.startswith(ENV_PREFIX)}
        assert ours, name
        unknown = ours - options.keys()
        assert not unknown, f"{name}: no `pagestream worker` flag for {sorted(unknown)}"


def test_worker_environment_equals_the_same_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose's defaults, read from the environment, parse like the same command line."""
    options = env_name_to_option()
    env = container_env(worker_services()["worker-0"], {})
    flags = []
    for name, value in env.items():
        if name.startswith(ENV_PREFIX) and value:  # an empty value means "not set"
            flags += [options[name], value]
    from_env = parse_worker_args(monkeypatch, env)
    from_flags = parse_worker_args(monkeypatch, {}, flags)
    assert from_env == from_flags


def test_host_settings_reach_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """`PAGESTREAM_MODEL=... docker compose up` changes what the worker runs."""
    host_env = {
        "PAGESTREAM_MODEL": "dummy:tiny",
        "PAGESTREAM_MAX_SEQS": "8",
        "PAGESTREAM_MAX_MODEL_LEN": "512",
        "PAGESTREAM_PA_MEMORY_FRACTION": "0.5",
        "PAGESTREAM_GRACE_S": "12",
        "PAGESTREAM_PREFIX": "staging",
        "PAGESTREAM_LOG_LEVEL": "DEBUG",
    }
    env = container_env(worker_services()["worker-0"], host_env)
    assert {key: env.get(key) for key in host_env} == host_env, "compose drops a host setting"
    args = parse_worker_args(monkeypatch, env)
    assert args["model"] == "dummy:tiny"
    assert args["max_seqs"] == 8
    assert args["max_model_len"] == 512
    assert args["pa_memory_fraction"] == 0.5
    assert args["grace_s"] == 12.0
    assert args["prefix"] == "staging"
    assert args["log_level"] == "DEBUG"
    assert args["redis_url"] == "redis://redis:6379/0"


# -- the observability profile ------------------------------------------------------------------


def collector_config(compose: dict[str, Any], collector: dict[str, Any]) -> dict[str, Any]:
    (reference,) = collector["configs"]
    config: dict[str, Any] = yaml.safe_load(compose["configs"][reference["source"]]["content"])
    return config


def endpoint_host_port(endpoint: str) -> tuple[str, int]:
    parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
    assert parts.hostname and parts.port, endpoint
    return parts.hostname, parts.port


def test_observability_profile_sends_traces_to_the_viewer() -> None:
    compose = load_compose()
    profiled = {
        name: service
        for name, service in compose["services"].items()
        if OBSERVABILITY in service.get("profiles", [])
    }
    collectors = [n for n, s in profiled.items() if "opentelemetry-collector" in s["image"]]
    assert len(collectors) == 1, f"one collector in the {OBSERVABILITY} profile: {profiled}"
    config = collector_config(compose, profiled[collectors[0]])
    http = config["receivers"]["otlp"]["protocols"]["http"]
    _, http_port = endpoint_host_port(http["endpoint"])
    pipelines = config["service"]["pipelines"]
    viewers = {
        endpoint_host_port(config["exporters"][exporter]["endpoint"])[0]
        for exporter in pipelines["traces"]["exporters"]
        if exporter.split("/")[0] in ("otlp", "otlp_grpc", "otlphttp", "otlp_http")
    }
    assert viewers and viewers <= profiled.keys() - set(collectors), viewers
    assert any(e.startswith("prometheus") for e in pipelines["metrics"]["exporters"])
    # the header's run line points the workers at this collector's OTLP/HTTP port
    documented = re.search(r"OTEL_EXPORTER_OTLP_ENDPOINT=(\S+)", COMPOSE_PATH.read_text())
    assert documented, "compose.yaml should say how to turn on export"
    assert endpoint_host_port(documented[1]) == (collectors[0], http_port)


# -- Docker Compose itself, where installed ----------------------------------------------------


def compose_command() -> list[str] | None:
    """`docker compose` (the plugin) or a standalone `docker-compose`, if it is v2 or newer."""
    candidates = [["docker", "compose"], ["docker-compose"]]
    for command in candidates:
        if shutil.which(command[0]) is None:
            continue
        try:
            version = subprocess.run(
                [*command, "version", "--short"],
                capture_output=True,
                text=True,
                timeout=COMPOSE_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        major = version.stdout.strip().lstrip("v").split(".")[0]
        if version.returncode == 0 and major.isdigit() and int(major) >= 2:
            return command
    return None


@pytest.mark.parametrize("profiles", [(), OPTIONAL_PROFILES])
def test_docker_compose_accepts_the_file(profiles: tuple[str, ...]) -> None:
    command = compose_command()
    if command is None:
        pytest.skip("no Docker Compose v2 here (`docker compose version` failed)")
    profile_args = [arg for profile in profiles for arg in ("--profile", profile)]
    result = subprocess.run(
        [*command, "-f", str(COMPOSE_PATH), *profile_args, "config", "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=COMPOSE_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr


# -- the gateway --------------------------------------------------------------------------------


def parse_gateway_args(monkeypatch: pytest.MonkeyPatch, env: Mapping[str, str]) -> dict[str, Any]:
    """`pagestream gateway` parsed with exactly ``env`` as its PAGESTREAM_* environment."""
    with monkeypatch.context() as patch:
        for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        return vars(build_parser().parse_args(["gateway"]))


def test_gateway_serves_the_workers_redis_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = load_compose()
    gateway = compose["services"]["gateway"]
    assert gateway["image"] == compose["x-worker"]["image"], "the workers' image"
    assert command_words(gateway["entrypoint"]) == ["pagestream", "gateway"]
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    args = parse_gateway_args(monkeypatch, container_env(gateway, {"PAGESTREAM_API_KEY": "a,b"}))
    worker_env = container_env(worker_services()["worker-0"], {})
    assert args["redis_url"] == worker_env["PAGESTREAM_REDIS_URL"]
    assert args["host"] == "0.0.0.0" and args["api_key"] == ["a", "b"]
    (published,) = gateway["ports"]
    host_ip, host_port, container_port = interpolate(str(published), {}).split(":")
    assert host_ip == "127.0.0.1" and int(container_port) == args["port"]
    assert int(host_port) == 8000
    argv = healthcheck_argv(gateway)
    assert f"http://127.0.0.1:{args['port']}/health" in " ".join(argv)
    assert parse_duration_s(gateway["healthcheck"]["start_period"]) >= MIN_START_PERIOD_S


# -- the cluster profile ------------------------------------------------------------------------


def cluster_nodes() -> dict[str, dict[str, Any]]:
    """The cluster profile's Redis primaries: redis-server with --cluster-enabled yes."""
    return {
        name: service
        for name, service in services().items()
        if "--cluster-enabled" in command_words(service.get("command", []))
    }


def option(words: list[str], flag: str) -> str:
    assert flag in words, f"{flag} missing from {words}"
    return words[words.index(flag) + 1]


def test_cluster_nodes_are_opt_in_persistent_primaries_with_their_own_volumes() -> None:
    compose = load_compose()
    nodes = cluster_nodes()
    assert sorted(nodes) == ["redis-node-0", "redis-node-1", "redis-node-2"]
    volumes = []
    for name, node in nodes.items():
        assert node.get("profiles") == [CLUSTER], f"{name}: `docker compose up` must not start it"
        words = command_words(node["command"])
        assert (
            option(words, "--cluster-enabled") == "yes" and option(words, "--appendonly") == "yes"
        )
        assert option(words, "--cluster-announce-hostname") == name  # clients reach it by name
        assert option(words, "--cluster-preferred-endpoint-type") == "hostname"
        (data,) = [mount for mount in mounts(node) if mount.target == "/data"]
        assert data.is_named_volume and data.source in compose["volumes"], name
        volumes.append(data.source)
        assert "PONG" in healthcheck_argv(node), name
        assert not node.get("ports"), f"{name}: no password, so not published"
    assert len(set(volumes)) == len(nodes), "each node needs its own data (nodes.conf, AOF)"
    assert compose["services"]["redis"].get("profiles") is None  # the default Redis stays


def test_cluster_create_joins_every_node_once_and_waits_for_them() -> None:
    create = services()[CLUSTER_CREATE]
    assert create.get("profiles") == [CLUSTER] and create["restart"] == "no"
    nodes = cluster_nodes()
    assert {name: dep["condition"] for name, dep in create["depends_on"].items()} == dict.fromkeys(
        nodes, "service_healthy"
    )
    script = interpolate(" ".join(command_words(create["command"])), {})
    create_line = script[script.index("redis-cli --cluster create") :]
    assert all(f"getent hosts {name} " in create_line for name in nodes)
    assert "--cluster-replicas 0" in create_line and "--cluster-yes" in create_line
    # again on the same volumes: skipped once the nodes know each other
    assert f"cluster_known_nodes:{len(nodes)}" in script.split("redis-cli --cluster create")[0]
    assert "cluster_state:ok" in script and "exit 1" in script


def test_cluster_workers_and_gateway_agree_on_the_cluster_and_its_shards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What `pagestream worker` and `gateway` read from their environment: a node's URL,
    --redis-cluster on, one shard per primary; the default services stay on the one Redis."""
    all_services, nodes = services(), cluster_nodes()
    workers = {n: w for n, w in worker_services().items() if CLUSTER in w.get("profiles", [])}
    assert list(workers) == ["worker-cluster-0"]
    parsed = {
        name: parse_worker_args(monkeypatch, container_env(w, {})) for name, w in workers.items()
    }
    gateway = all_services[CLUSTER_GATEWAY]
    parsed[CLUSTER_GATEWAY] = parse_gateway_args(monkeypatch, container_env(gateway, {}))
    for name, args in parsed.items():
        assert args["redis_cluster"] is True and args["shards"] == len(nodes), name
        host = urlsplit(args["redis_url"]).hostname
        assert host in nodes, f"{name}: {args['redis_url']} is no cluster node"
    assert gateway.get("profiles") == [CLUSTER]
    assert set(gateway["depends_on"]) == {CLUSTER_CREATE, *workers}
    assert gateway["depends_on"][CLUSTER_CREATE]["condition"] == "service_completed_successfully"
    assert command_words(gateway["entrypoint"]) == ["pagestream", "gateway"]
    worker_env = container_env(workers["worker-cluster-0"], {})
    default_env = container_env(worker_services()["worker-0"], {})
    assert worker_env["PAGESTREAM_MODEL"] == default_env["PAGESTREAM_MODEL"]
    default = parse_worker_args(monkeypatch, default_env)
    assert default["redis_cluster"] is False and default["shards"] == 1
    header = COMPOSE_PATH.read_text().split("\nname:")[0]  # says how to start it
    assert f"docker compose --profile {CLUSTER} up -d {CLUSTER_GATEWAY}" in header
