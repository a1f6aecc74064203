"""Deployment: vLLM's metric set on a live server (both name prefixes), and the deployment files (Dockerfile, its
entrypoint, docker-compose.yml, Kubernetes manifests, Prometheus config and alert rules, Grafana dashboard) checked
against the CLI and the live /metrics.

The live servers wrap the shared ``serving_engine`` (tests/conftest.py) with uvicorn in a thread, as test_serving.py
does: one per prefix (``paged_jax``, then ``--metrics-prefix vllm``), each shut down before the next starts. No image
is built here (no container runtime on the test machines): the files are parsed and cross-checked instead.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml

from tests.test_serving import ServerThread

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "smollm2-deploy"

# Every metric the published vLLM Grafana dashboard queries (names only), from
# https://github.com/vllm-project/vllm/blob/004f771f3a6b49597546b05c7d83686d1e121fa0/examples/online_serving/prometheus_grafana/grafana.json
VLLM_DASHBOARD_METRICS = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
# The v1 engine's PrometheusStatLogger metrics (metric names; a histogram's samples are name_bucket/_sum/_count), from
# https://github.com/vllm-project/vllm/blob/005a810bc40faa25b8870fbc8559c3462581eee3/vllm/v1/metrics/loggers.py
# plus the two newer names inter_token_latency_seconds and request_time_per_output_token_seconds. Not exported:
# the deprecated gpu_prefix_cache_queries/hits and time_per_prefill_token_request_seconds (dropped by later vLLM),
# lora_requests_info and the speculative-decoding metrics (features this engine lacks).
VLLM_GAUGES = ("num_requests_running", "num_requests_waiting", "gpu_cache_usage_perc", "kv_cache_usage_perc",
               "cache_config_info")
VLLM_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                 "generation_tokens", "request_success")
VLLM_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
                   "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
                   "time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
                   "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                   "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
                   "request_decode_time_seconds")


def expected_sample_names(prefix: str) -> set[str]:
    names = {f"{prefix}:{name}" for name in VLLM_GAUGES}
    names |= {f"{prefix}:{name}_total" for name in VLLM_COUNTERS}
    names |= {f"{prefix}:{name}_{suffix}" for name in VLLM_HISTOGRAMS for suffix in ("bucket", "sum", "count")}
    return names


def samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    """``{sample name: [(labels, value), ...]}`` of a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def value(found, name: str, **labels) -> float:
    """The one sample ``name`` whose labels include ``labels`` (0.0 when absent: a counter not yet created)."""
    matches = [v for sample_labels, v in found.get(name, []) if labels.items() <= sample_labels.items()]
    assert len(matches) <= 1, (name, labels, matches)
    return matches[0] if matches else 0.0


def metric_names_in(text: str, prefix: str = "paged_jax") -> set[str]:
    return set(re.findall(rf"\b{prefix}:[a-zA-Z0-9_:]+", text))


# ------------------------------------------------------------------------------------------- live servers
@pytest.fixture(scope="module", params=["paged_jax", "vllm"])
def server(request, serving_engine):
    from serving.app import create_app

    app = create_app(serving_engine, served_model_name=MODEL_NAME, metrics_prefix=request.param)
    with ServerThread(app) as handle:
        handle.prefix = request.param
        yield handle


def scrape(server) -> dict[str, list[tuple[dict, float]]]:
    r = httpx.get(server.base_url + "/metrics", timeout=30)
    assert r.status_code == 200
    return samples(r.text)


def complete(server, **body) -> dict:
    body = {"model": MODEL_NAME, "temperature": 0.0, "ignore_eos": True, **body}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_request_metrics_move_with_requests(server):
    p = server.prefix + ":"
    before = scrape(server)
    one = complete(server, prompt="The capital of France is", max_tokens=5)
    middle = scrape(server)
    two = complete(server, prompt="Count: one, two,", max_tokens=3, n=2)
    after = scrape(server)

    def delta(name, **labels):
        return value(after, p + name, **labels) - value(before, p + name, **labels)

    prompt_one, prompt_two = one["usage"]["prompt_tokens"], two["usage"]["prompt_tokens"]  # counted once for n
    assert one["usage"]["completion_tokens"] == 5 and two["usage"]["completion_tokens"] == 6
    # Per choice (vLLM counts each of n sequences as a request): 3 choices, all cut by max_tokens.
    assert delta("request_success_total", finished_reason="length") == 3
    assert delta("request_generation_tokens_count") == 3 and delta("request_generation_tokens_sum") == 5 + 3 + 3
    assert delta("request_prompt_tokens_count") == 3
    assert delta("request_prompt_tokens_sum") == prompt_one + 2 * prompt_two
    assert delta("request_params_max_tokens_sum") == 5 + 3 + 3
    # Per request: n, the longest choice, the phase times.
    assert delta("request_params_n_count") == 2 and delta("request_params_n_sum") == 1 + 2
    assert delta("request_max_num_generation_tokens_sum") == 5 + 3
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds", "time_to_first_token_seconds",
                 "request_time_per_output_token_seconds"):
        assert delta(f"{name}_count") == 2, name
    # Running = prefill + decode, from the same engine timestamps.
    assert math.isclose(delta("request_inference_time_seconds_sum"),
                        delta("request_prefill_time_seconds_sum") + delta("request_decode_time_seconds_sum"),
                        rel_tol=1e-6, abs_tol=1e-9)
    assert delta("request_inference_time_seconds_sum") > 0
    # One inter-token observation per output after the first: 4 for the 5 tokens of the first request (the n = 2
    # request's choices may start in different steps); the older name holds the same observations.
    itl = p + "inter_token_latency_seconds_count"
    assert value(middle, itl) - value(before, itl) == 4 and value(after, itl) - value(middle, itl) >= 2
    assert delta("time_per_output_token_seconds_count") == delta("inter_token_latency_seconds_count")
    # Tokens per engine step add up to the token counters.
    tokens = delta("prompt_tokens_total") + delta("generation_tokens_total")
    assert delta("generation_tokens_total") == 11 and delta("prompt_tokens_total") == prompt_one + 2 * prompt_two
    assert delta("iteration_tokens_total_sum") == tokens and delta("iteration_tokens_total_count") >= 3


def test_labels_buckets_and_cache_config(server):
    from serving.metrics import build_1_2_5_buckets

    complete(server, prompt="Hello", max_tokens=2)
    found = scrape(server)
    ours = {name: entries for name, entries in found.items() if name.startswith(server.prefix + ":")}
    assert ours and not [name for name in found if name.startswith(("vllm:", "paged_jax:"))
                         and not name.startswith(server.prefix + ":")]
    for name, entries in ours.items():
        for labels, _ in entries:
            assert labels["engine"] == "0", name
            if not name.endswith("cache_config_info"):
                assert labels["model_name"] == MODEL_NAME, name
    p = server.prefix + ":"
    edges = sorted(float(labels["le"]) for labels, _ in found[p + "request_prompt_tokens_bucket"])
    assert edges == [*map(float, build_1_2_5_buckets(256)), math.inf]  # max_model_len 256
    edges = sorted(float(labels["le"]) for labels, _ in found[p + "iteration_tokens_total_bucket"])
    assert edges[:3] == [1.0, 8.0, 16.0] and edges[-2:] == [16384.0, math.inf]
    [(info, one)] = found[p + "cache_config_info"]
    assert one == 1.0 and info["num_gpu_blocks"] == "80" and info["block_size"] == "16"
    assert info["enable_prefix_caching"] == "True"
    assert value(found, p + "gpu_cache_usage_perc") == value(found, p + "kv_cache_usage_perc")


def test_every_dashboard_and_alert_metric_exists(server):
    complete(server, prompt="Hi", max_tokens=2)  # request_success_total appears with its first finish
    names = set(scrape(server))
    prefix = server.prefix
    assert expected_sample_names(prefix) <= names, sorted(expected_sample_names(prefix) - names)
    vllm_dashboard = {name.replace("vllm:", f"{prefix}:", 1) for name in VLLM_DASHBOARD_METRICS}
    assert vllm_dashboard <= names, sorted(vllm_dashboard - names)
    ours = (metric_names_in((ROOT / "deploy/grafana/dashboards/paged-jax.json").read_text())
            | metric_names_in((ROOT / "deploy/prometheus/alerts.yml").read_text()))
    assert len(ours) >= 20
    ours = {name.replace("paged_jax:", f"{prefix}:", 1) for name in ours}
    assert ours <= names, sorted(ours - names)


def test_ping_version_health(server):
    from importlib.metadata import version

    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/version").json() == {"version": version("paged-jax")}


def test_iteration_tokens_one_observation_per_engine_step():
    from serving.metrics import ServingMetrics

    metrics = ServingMetrics("m", max_model_len=64)
    # (steps launched, prompt tokens, generation tokens): start; a step; no step since (idle loop); the last step of
    # overlapped scheduling (nothing launched, tokens resolved); two steps in one snapshot (cannot be split: skipped).
    for steps, prompt, generated in ((0, 0, 0), (1, 7, 1), (1, 7, 1), (1, 7, 3), (3, 14, 6)):
        metrics.update_engine_stats({"num_steps": steps, "prompt_tokens_total": prompt,
                                     "generation_tokens_total": generated})
    found = samples(metrics.render().decode())
    assert value(found, "paged_jax:iteration_tokens_total_count") == 2
    assert value(found, "paged_jax:iteration_tokens_total_sum") == 8 + 2
    assert value(found, "paged_jax:iteration_tokens_total_bucket", le="1.0") == 0
    assert value(found, "paged_jax:iteration_tokens_total_bucket", le="8.0") == 2


def test_metrics_prefix_flag(capsys):
    from serving.cli import parse_serve_args
    from serving.settings import app_kwargs, engine_args_from_namespace

    _, args = parse_serve_args(["--metrics-prefix", "vllm"])
    assert app_kwargs(args, engine_args_from_namespace(args))["metrics_prefix"] == "vllm"
    assert parse_serve_args([])[1].metrics_prefix == "paged_jax"
    with pytest.raises(SystemExit) as info:
        parse_serve_args(["--metrics-prefix", "vllm:"])  # a name prefix, the colon is added
    assert info.value.code == 2 and "--metrics-prefix" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- deployment files
def serve_args(args: list[str]):
    """The parsed `paged-jax serve` flags of an image's arguments (the entrypoint's own flags first, as it runs)."""
    from paged_jax.entrypoints.cli import normalize_flag_spelling
    from serving.cli import build_parser

    argv = ["--host", "0.0.0.0", "--compilation-cache-dir", "/cache/paged_jax/jax_cache", *args]
    return build_parser().parse_args(normalize_flag_spelling(argv))


def dockerfile_env() -> dict[str, str]:
    env = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ENV "):
            env.update(item.split("=", 1) for item in line[4:].split())
    return env


@pytest.mark.parametrize("manifest, gpus", [("paged-jax.yaml", 1), ("paged-jax-tp.yaml", 4)])
def test_kubernetes_manifests(manifest, gpus):
    from serving.routes.system import router

    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((ROOT / "deploy/kubernetes" / manifest).read_text())}
    assert set(docs) == {"PersistentVolumeClaim", "Deployment", "Service"}
    pod = docs["Deployment"]["spec"]["template"]
    [container] = pod["spec"]["containers"]
    args = serve_args(container["args"])
    assert args.tensor_parallel_size == gpus and args.model_tag
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    [port] = container["ports"]
    assert port["containerPort"] == args.port and port["name"] == "http"
    routes = {route.path for route in router.routes}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        assert "/health" in routes
    # A cold start (download, conversion, compile) has at least 20 minutes before the kubelet gives up.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == args.port
    assert annotations["prometheus.io/path"] == "/metrics" and "/metrics" in routes
    # The cache volume is the PVC and holds both caches the image points at.
    [volume] = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]
    [mount] = container["volumeMounts"]
    env = dockerfile_env()
    for cache in (env["HF_HOME"], env["PAGED_JAX_CACHE"]):
        assert cache.startswith(mount["mountPath"] + "/"), cache
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    service = docs["Service"]["spec"]
    assert service["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert service["ports"][0]["targetPort"] == "http"


def test_compose_prometheus_and_grafana_files():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    [job] = prometheus["scrape_configs"]
    [target] = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    for name, target_stage in (("server-gpu", "cuda"), ("server-cpu", "cpu")):
        server = services[name]
        command = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg) for arg in server["command"]]  # compose defaults
        args = serve_args(command)
        assert server["ports"] == [f"{args.port}:{args.port}"] and int(port) == args.port
        assert host in server["networks"]["default"]["aliases"]
        assert server["build"]["target"] == target_stage
        assert re.search(rf"^FROM \S+ AS {target_stage}$", (ROOT / "Dockerfile").read_text(), re.M)
    assert job["metrics_path"] == "/metrics"
    # The config and rule files reach the paths Prometheus reads them from.
    [volume] = services["prometheus"]["volumes"]
    local, container_dir = volume.split(":")[:2]
    assert f"--config.file={container_dir}/prometheus.yml" in services["prometheus"]["command"]
    assert (ROOT / local / "prometheus.yml").is_file()
    for rule_file in prometheus["rule_files"]:
        assert (ROOT / local / Path(rule_file).relative_to(container_dir)).is_file(), rule_file
    # Grafana: provisioning (data source = the Prometheus service; the dashboard directory as mounted).
    grafana_mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in services["grafana"]["volumes"]}
    provisioning = grafana_mounts["/etc/grafana/provisioning"]
    [source] = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and "9090:9090" in services["prometheus"]["ports"]
    [provider] = yaml.safe_load((provisioning / "dashboards/paged-jax.yml").read_text())["providers"]
    dashboards = grafana_mounts[provider["options"]["path"]]
    dashboard = json.loads((dashboards / "paged-jax.json").read_text())
    assert dashboard["uid"] == "paged-jax" and len(dashboard["panels"]) >= 11
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(metric_names_in(t["expr"]) for t in panel["targets"]), panel["title"]


def test_alert_rules():
    groups = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len({rule["alert"] for rule in rules}) == len(rules) >= 5
    for rule in rules:
        assert rule["expr"].strip() and rule["labels"]["severity"] in ("warning", "critical")
        assert re.fullmatch(r"\d+[smh]", rule["for"]) and rule["annotations"]["summary"]


def test_dockerfile_and_dockerignore():
    text = (ROOT / "Dockerfile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert re.search(r"^ARG CUDA_EXTRA=(\S+)$", text, re.M).group(1) in extras and "cuda12" in extras
    assert re.search(r"^FROM \$\{CUDA_IMAGE\} AS cuda$", text, re.M) and "ARG CUDA_IMAGE=nvidia/cuda:" in text
    assert text.count('ENTRYPOINT ["/usr/local/bin/paged-jax-entrypoint"]') == 2
    assert text.count("USER paged") == 2 and "useradd --uid 1000" in text
    env = dockerfile_env()
    volumes = set(re.findall(r'^VOLUME \["([^"]+)", "([^"]+)"\]$', text, re.M)[0])
    assert volumes == {env["HF_HOME"], env["PAGED_JAX_CACHE"]}
    # Everything the image copies exists and survives .dockerignore ("*" then "!path" exceptions).
    copied = [src for line in text.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]]
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for src in copied:
        assert (ROOT / src).exists() and src.rstrip("/") in allowed, src


def test_entrypoint_runs_serve_on_every_interface(tmp_path):
    entrypoint = ROOT / "deploy/docker/entrypoint.sh"
    # With a stand-in `paged-jax` that prints its arguments: what the entrypoint runs.
    fake = tmp_path / "bin" / "paged-jax"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "PAGED_JAX_CACHE": "/cache/paged_jax"}
    run = subprocess.run(["sh", str(entrypoint), "org/model", "--port=9000", "--host", "127.0.0.1"], env=env,
                         capture_output=True, text=True, check=True)
    argv = run.stdout.splitlines()
    assert argv[:5] == ["serve", "--host", "0.0.0.0", "--compilation-cache-dir", "/cache/paged_jax/jax_cache"]
    args = serve_args(argv[5:])
    assert (args.model_tag, args.port, args.host) == ("org/model", 9000, "127.0.0.1")  # later flags win
    # With the console script pyproject.toml installs (the same entry point, run from this checkout): the CLI answers.
    script = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["paged-jax"]
    module, function = script.split(":")
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "import sys; from {module} import {function}; '
                    f'sys.exit({function}())" "$@"\n')
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(["sh", str(entrypoint), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage: paged-jax serve" in run.stdout and "--metrics-prefix" in run.stdout


def test_make_serve_passes_args_to_the_server():
    """``make serve ARGS=...`` hands the flags to ``python -m serving`` after the defaults (argparse: the last wins)."""
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    dry_run = subprocess.run(["make", "-n", "-C", str(root), "serve", "ARGS=--port 9000 --max-model-len 1024"],
                             capture_output=True, text=True, check=True).stdout
    serve_line = next(line for line in dry_run.splitlines() if "-m serving" in line)
    assert serve_line.rstrip().endswith("--port 8000 --port 9000 --max-model-len 1024")
