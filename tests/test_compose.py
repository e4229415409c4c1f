"""compose.yaml checked structurally: services, health, secrets from the environment, pinned images."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_services_have_health_and_no_literal_secrets():
    text = (ROOT / "compose.yaml").read_text()
    doc = yaml.safe_load(text)
    services = doc["services"]
    assert {"nats", "seaweedfs"} <= set(services)
    assert "-js" in services["nats"]["command"] and "8222" in services["nats"]["command"]
    for name in ("nats", "seaweedfs"):
        assert "healthcheck" in services[name], name
        for port in services[name].get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    for key, value in services["seaweedfs"]["environment"].items():
        assert re.fullmatch(r"\$\{[A-Z_]+(:\?[^}]*|:-[^}]*)?\}", str(value)), f"{key} must come from the environment"
    assert set(doc["volumes"]) == {"nats-data", "s3-data", "models", "dflash-cache"}


def test_compose_dashboard_service():
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    dash = doc["services"]["dashboard"]
    assert dash["command"][0] == "dashboard" and "8501" in dash["command"]
    assert dash["ports"] and all(p.startswith("127.0.0.1:") and p.endswith(":8501") for p in dash["ports"])
    assert "/_stcore/health" in " ".join(dash["healthcheck"]["test"])
    assert {name: dep["condition"] for name, dep in dash["depends_on"].items()} == {
        "nats": "service_healthy", "seaweedfs": "service_healthy"}
    env = dash["environment"]
    assert env["DFLASH_NATS_URL"].endswith("nats://nats:4222}") and env["DFLASH_S3_ENDPOINT"].endswith("seaweedfs:8333}")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "DFLASH_DASHBOARD_PASSWORD"):
        assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]*\}", env[key]), f"{key} must be required from the environment"
    # Non-loopback inside the container: the password the CLI then requires is set.
    assert "0.0.0.0" in dash["command"] and "DFLASH_DASHBOARD_PASSWORD" in env


def test_compose_images_pinned_from_variables_and_no_minio():
    """Every image names a version (no `:latest`, no MinIO: its images are gone) and comes from a variable
    whose default is the upstream image, so a machine without a registry can point at local builds."""
    text = (ROOT / "compose.yaml").read_text()
    assert "minio" not in text.lower()
    images = re.findall(r"^\s+image: (.+)$", text, flags=re.M)
    assert images
    for image in images:
        m = re.fullmatch(r"\$\{[A-Z_]+:-([^}]+)\}", image.strip())
        assert m, f"image {image!r} is not a variable with an upstream default"
        name, _, tag = m.group(1).rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d", tag), f"image {image!r} is not pinned"
    assert re.search(r"\bdflash (?!pipeline)", text) is None  # the command is `dfpipe`


def _active(services: dict, profile: str | None) -> dict:
    """The services `docker compose [--profile P] up` starts: those without profiles, plus P's."""
    return {n: s for n, s in services.items() if not s.get("profiles") or profile in s["profiles"]}


def _gpu_ids(service: dict) -> list[str]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [i for d in devices if "gpu" in d.get("capabilities", []) for i in d.get("device_ids", [])]


def test_compose_profiles_form_complete_pipelines():
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = doc["services"]
    for profile in (None, "cpu", "gpu"):
        active = _active(services, profile)
        for name, svc in active.items():  # nothing waits on a service the profile does not start
            for dep in svc.get("depends_on", {}):
                assert dep in active, f"profile {profile}: {name} depends on {dep}, which is not started"
            for port in svc.get("ports", []):
                assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
            long_running = svc.get("restart") not in (None, "no")
            assert long_running or name in ("eval-gpu", "eval-cpu"), f"{name} has no restart policy"
    cpu, gpu = _active(services, "cpu"), _active(services, "gpu")
    stages = ("feeder", "tokenizer", "dashboard", "nats", "seaweedfs")
    assert {"generator-cpu", "trainer-cpu", "eval-cpu", *stages} <= set(cpu)
    assert not any(_gpu_ids(s) for s in cpu.values()), "the cpu profile must run without GPUs"
    assert cpu["generator-cpu"]["command"][cpu["generator-cpu"]["command"].index("--backend") + 1] == "hf"
    # gpu: one SGLang server per GPU (by device id), one generator bound to each, a GPU trainer
    servers = {n: s for n, s in gpu.items() if n.startswith("sglang-")}
    assert len(servers) >= 2 and sorted(_gpu_ids(s)[0] for s in servers.values()) == ["0", "1"]
    for name, s in servers.items():
        assert "/health_generate" in " ".join(s["healthcheck"]["test"])
        assert any(v.startswith("models:") for v in s["volumes"]), f"{name} has no model volume"
        assert "sglang.launch_server" in s["command"]
        gen = gpu["generator-" + name.split("-")[1]]
        assert gen["depends_on"][name]["condition"] == "service_healthy"
        assert f"http://{name}:30000" in gen["command"] and "sglang" in gen["command"]
    assert _gpu_ids(gpu["trainer-gpu"]) and gpu["eval-gpu"]["depends_on"] == {
        "trainer-gpu": {"condition": "service_completed_successfully"}}
    for name in ("generator-0", "generator-cpu", "feeder", "tokenizer", "trainer-cpu", "trainer-gpu"):
        deps = services[name]["depends_on"]
        assert deps["nats"]["condition"] == "service_healthy", name
        assert deps["seaweedfs"]["condition"] == "service_healthy", name
        env = services[name]["environment"]
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]*\}", env[key]), f"{name}: {key} must come from the environment"
    # commands are real CLI commands of this project
    from shared.cli import build_parser

    parser = build_parser()
    for name in ("generator-0", "generator-cpu", "feeder", "tokenizer", "trainer-cpu", "eval-cpu", "dashboard"):
        argv = [a.replace("${DFLASH_RUN:-demo}", "demo") for a in services[name]["command"]]
        argv = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in argv]
        parser.parse_args(argv)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
@pytest.mark.stack  # runs docker-compose
def test_compose_file_validates_with_docker_compose():
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "DFLASH_DASHBOARD_PASSWORD": "p"}
    for profile in ("cpu", "gpu"):
        r = subprocess.run(["docker-compose", "-f", str(ROOT / "compose.yaml"), "--profile", profile, "config", "-q"],
                           env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    env.pop("AWS_SECRET_ACCESS_KEY")
    r = subprocess.run(["docker-compose", "-f", str(ROOT / "compose.yaml"), "config", "-q"], env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "AWS_SECRET_ACCESS_KEY" in r.stderr  # a missing secret is named, not defaulted
