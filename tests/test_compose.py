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
