"""The gateway's front (core/gateway_front.py): the nginx site the operator installs and the
simulated gateway runs, and the fleet file's gateway.front."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from spark_pipelines.cli.main import main
from spark_pipelines.core.fleet import SEED_FLEET, FleetError, load_fleet, parse_fleet
from spark_pipelines.core.gateway_front import TRIES, nginx_site


def site() -> str:
    return nginx_site(proxy_port=4000, litellm_port=4001, idle_timeout_s=900)


def test_the_site_holds_clients_and_sends_again_what_litellm_reset_unanswered():
    text = site()
    assert "listen 4000;" in text and text.count("server 127.0.0.1:4001 max_fails=0;") == TRIES
    assert "proxy_next_upstream error non_idempotent;" in text and f"proxy_next_upstream_tries {TRIES};" in text
    assert "proxy_set_header Connection close;" in text  # a new LiteLLM connection per request
    assert "proxy_buffering off;" in text  # streams flow as they come
    assert "proxy_read_timeout 900s;" in text and "keepalive_timeout 900s;" in text
    with pytest.raises(ValueError, match="cannot share port 4000"):
        nginx_site(proxy_port=4000, litellm_port=4000, idle_timeout_s=900)


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (scripts/bootstrap.sh base)")
def test_nginx_accepts_the_site(tmp_path):
    (tmp_path / "site.conf").write_text(site().replace("listen 4000;", "listen 127.0.0.1:14999;"))
    main_conf = tmp_path / "nginx.conf"
    main_conf.write_text(f"pid {tmp_path}/nginx.pid;\nerror_log {tmp_path}/error.log;\nevents {{}}\n"
                         f"http {{\n    include {tmp_path}/site.conf;\n}}\n")
    r = subprocess.run(["nginx", "-t", "-q", "-c", str(main_conf), "-e", str(tmp_path / "error.log")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_the_fleet_file_gives_the_front_its_ports_once(tmp_path, capsys):
    seed = load_fleet(SEED_FLEET)
    assert seed.gateway.front is not None and seed.gateway.front.litellm_port != seed.gateway.proxy_port
    doc = yaml.safe_load(open(SEED_FLEET))
    doc["gateway"]["front"] = {"litellm_port": doc["gateway"]["proxy_port"]}
    with pytest.raises(FleetError, match="front.litellm_port 4000 is proxy_port"):
        parse_fleet(doc, "test")
    assert main(["gateway-front", "--fleet", SEED_FLEET]) == 0
    assert capsys.readouterr().out == nginx_site(proxy_port=4000, litellm_port=4001, idle_timeout_s=900,
                                                 source=SEED_FLEET)
    del doc["gateway"]["front"]
    path = tmp_path / "nofront.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["gateway-front", "--fleet", str(path)]) == 2
    assert "gateway.front is not set" in capsys.readouterr().err
