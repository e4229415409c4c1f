"""compose.yaml checked structurally (no Docker engine on CI machines)."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_services_have_health_and_no_literal_secrets():
    text = (ROOT / "compose.yaml").read_text()
    doc = yaml.safe_load(text)
    services = doc["services"]
    assert {"nats", "minio", "minio-init"} <= set(services)
    assert "-js" in services["nats"]["command"] and "8222" in services["nats"]["command"]
    for name in ("nats", "minio"):
        assert "healthcheck" in services[name], name
        for port in services[name].get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    for key, value in services["minio"]["environment"].items():
        assert re.fullmatch(r"\$\{[A-Z_]+(:\?[^}]*|:-[^}]*)?\}", str(value)), f"{key} must come from the environment"
    assert set(doc["volumes"]) == {"nats-data", "minio-data"}


def test_compose_dashboard_service():
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    dash = doc["services"]["dashboard"]
    assert dash["command"][0] == "dashboard" and "8501" in dash["command"]
    assert dash["ports"] and all(p.startswith("127.0.0.1:") and p.endswith(":8501") for p in dash["ports"])
    assert "/_stcore/health" in " ".join(dash["healthcheck"]["test"])
    assert {name: dep["condition"] for name, dep in dash["depends_on"].items()} == {
        "nats": "service_healthy", "minio": "service_healthy"}
    env = dash["environment"]
    assert env["DFLASH_NATS_URL"].endswith("nats://nats:4222}") and env["DFLASH_S3_ENDPOINT"].endswith("minio:9000}")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "DFLASH_DASHBOARD_PASSWORD"):
        assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]*\}", env[key]), f"{key} must be required from the environment"
    # Non-loopback inside the container: the password the CLI then requires is set.
    assert "0.0.0.0" in dash["command"] and "DFLASH_DASHBOARD_PASSWORD" in env
