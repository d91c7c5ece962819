"""docker-compose.yml, .env.example, Dockerfile and docker/: structure and agreement, checked without a Docker engine.

The running topology itself is exercised with real processes in test_tracking_server.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml
from helpers import REPO

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
VAR = re.compile(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)(?:(:?[-?])([^}]*))?\}")
TEST_PASSWORD = "0123456789abcdef"  # what a user puts into .env: the template has none


def env_example() -> dict[str, str]:
    out = {}
    for line in (REPO / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


class Refused(Exception):
    """What `docker compose` does for ${VAR:?message} with VAR unset or empty: stop with the message."""


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message}, ${VAR?message}."""

    def one(m) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        if op in (":-", ":?") and not value or op in ("-", "?") and value is None:
            if op.endswith("?"):
                raise Refused(f"{name}: {arg}")
            return arg
        return env[name]

    return VAR.sub(one, text).replace("$$", "$")


def filled_env() -> dict[str, str]:
    return {**env_example(), "POSTGRES_PASSWORD": TEST_PASSWORD}


def compose_text() -> str:
    return (REPO / "docker-compose.yml").read_text() + (REPO / "docker" / "compose.gpu.yml").read_text()


def flat(value) -> str:
    return value if isinstance(value, str) else " ".join(value)


def test_services_and_profiles():
    assert set(SERVICES) == {"postgres", "mlflow", "optuna-dashboard", "trainer"}
    assert SERVICES["trainer"]["profiles"] == ["train"]  # `docker compose up` starts the infrastructure only
    for name in ("postgres", "mlflow", "optuna-dashboard"):
        assert "healthcheck" in SERVICES[name], name
    assert "pg_isready" in flat(SERVICES["postgres"]["healthcheck"]["test"])


def test_every_variable_is_in_env_example_and_every_example_is_used():
    env = env_example()
    used = {m.group(1) for m in VAR.finditer(compose_text())}
    assert used - set(env) == set(), "variables without a value in .env.example"
    init = (REPO / "docker" / "postgres" / "init-sweeps.sh").read_text()
    assert set(env) - used - set(re.findall(r"\$\{?([A-Z_]+)", init)) == set(), "unused .env.example entries"
    # credentials and ports must come from .env, never be hard-coded
    assert "change-me" not in compose_text()


def test_named_volumes_declared_and_used():
    declared = set(COMPOSE["volumes"])
    used = {v.split(":")[0] for s in SERVICES.values() for v in s.get("volumes", []) if not v.startswith((".", "/"))}
    assert used == declared
    assert "pgdata:/var/lib/postgresql/data" in SERVICES["postgres"]["volumes"]
    assert any(v.startswith("mlartifacts:") for v in SERVICES["mlflow"]["volumes"])


def test_ports_agree_with_commands_and_healthchecks():
    env = filled_env()
    ports = {name: [interpolate(p, env) for p in s.get("ports", [])] for name, s in SERVICES.items()}
    assert ports["postgres"] == [f"127.0.0.1:{env['POSTGRES_PORT']}:5432"]
    assert ports["mlflow"] == [f"127.0.0.1:{env['MLFLOW_PORT']}:5000"]
    assert ports["optuna-dashboard"] == [f"127.0.0.1:{env['DASHBOARD_PORT']}:8080"]
    ml = flat(SERVICES["mlflow"]["command"])
    assert "--port 5000" in ml and "--host 0.0.0.0" in ml and "--serve-artifacts" in ml
    assert "localhost:5000/health" in flat(SERVICES["mlflow"]["healthcheck"]["test"])
    dash = SERVICES["optuna-dashboard"]
    assert "port=8080" in flat(dash["entrypoint"]) and "host='0.0.0.0'" in flat(dash["entrypoint"])
    assert "localhost:8080/api/studies" in flat(dash["healthcheck"]["test"])


def test_urls_point_at_the_services_and_databases():
    env = filled_env()
    ml_env = {k: interpolate(str(v), env) for k, v in SERVICES["mlflow"]["environment"].items()}
    pg_user, pg_pass = env["POSTGRES_USER"], env["POSTGRES_PASSWORD"]
    assert (
        ml_env["MLFLOW_BACKEND_STORE_URI"]
        == f"postgresql+psycopg2://{pg_user}:{pg_pass}@postgres:5432/{env['POSTGRES_DB']}"
    )
    assert ml_env["MLFLOW_ARTIFACTS_DESTINATION"] in [v.split(":", 1)[1] for v in SERVICES["mlflow"]["volumes"]]
    hosts = ml_env["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")  # the variable `mlflow server` reads
    assert "mlflow:5000" in hosts and f"localhost:{env['MLFLOW_PORT']}" in hosts  # containers call it by name
    sweeps_url = f"postgresql+psycopg2://{pg_user}:{pg_pass}@postgres:5432/{env['SWEEPS_DB']}"
    trainer_env = {k: interpolate(str(v), env) for k, v in SERVICES["trainer"]["environment"].items()}
    assert trainer_env["OPTUNA_STORAGE"] == sweeps_url
    assert trainer_env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    dash_env = {k: interpolate(str(v), env) for k, v in SERVICES["optuna-dashboard"]["environment"].items()}
    assert dash_env["OPTUNA_STORAGE"] == sweeps_url  # dashboard reads the same study DB
    pg_env = SERVICES["postgres"]["environment"]
    assert {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB", "SWEEPS_DB"} <= set(pg_env)
    # the init script creates the database named by SWEEPS_DB, as the owner the others log in as
    init = (REPO / "docker" / "postgres" / "init-sweeps.sh").read_text()
    assert "CREATE DATABASE" in init and "SWEEPS_DB" in init and "POSTGRES_USER" in init
    mount = [v for v in SERVICES["postgres"]["volumes"] if "init-sweeps.sh" in v][0]
    assert mount.split(":")[1].startswith("/docker-entrypoint-initdb.d/")
    assert (REPO / mount.split(":")[0]).is_file()


def test_no_password_on_a_command_line_and_no_install_at_start():
    """What a service runs (entrypoint, command) holds no credential (`ps` would show it), and no service installs
    packages when it starts (a restart must not need a package index)."""
    env = filled_env()
    for name, svc in SERVICES.items():
        argv = interpolate(flat(svc.get("entrypoint", [])) + " " + flat(svc.get("command", [])), env)
        assert env["POSTGRES_PASSWORD"] not in argv, name
        assert "pip install" not in argv, name
    mlflow_build = SERVICES["mlflow"]["build"]
    dockerfile = (REPO / mlflow_build / "Dockerfile").read_text()
    assert re.search(r"^FROM ghcr.io/mlflow/mlflow:v3\.17\.2$", dockerfile, re.M)
    assert re.search(r"^RUN pip install .*psycopg2-binary", dockerfile, re.M)


def test_dependencies_wait_for_health():
    for name, s in SERVICES.items():
        for dep, cond in s.get("depends_on", {}).items():
            assert "healthcheck" in SERVICES[dep]
            assert cond["condition"] == "service_healthy", (name, dep)
    assert set(SERVICES["trainer"]["depends_on"]) == {"postgres", "mlflow"}


def test_trainer_image_and_command():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert SERVICES["trainer"]["build"] == "." and SERVICES["optuna-dashboard"]["image"] == SERVICES["trainer"]["image"]
    assert 'ENTRYPOINT ["mhc"]' in dockerfile and ".[postgres,dashboard]" in dockerfile
    for path in re.findall(r"^COPY (\S+)", dockerfile, re.M):
        assert (REPO / path).exists(), path
    env = env_example()
    cmd = [interpolate(c, env) for c in SERVICES["trainer"]["command"]]
    assert cmd[:2] == ["sweep", "run"] and (REPO / cmd[2]).is_file() and cmd[cmd.index("--workers") + 1].isdigit()
    gpu = yaml.safe_load((REPO / "docker" / "compose.gpu.yml").read_text())["services"]["trainer"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert re.search(r"^ARG TORCH_INDEX_URL", dockerfile, re.M) and "TORCH_INDEX_URL" in gpu["build"]["args"]


def test_the_sweep_command_in_the_image_parses():
    """What the trainer runs (`mhc sweep run <SWEEP_FILE> --workers N`) is a valid invocation here too."""
    from mhc_lightning.sweeps.cli import build_parser

    env = env_example()
    cmd = [interpolate(c, env) for c in SERVICES["trainer"]["command"]]
    assert cmd[0] == "sweep"  # the image's entrypoint is `mhc`
    args = build_parser().parse_args(cmd[1:])
    assert args.command == "run" and args.workers == int(env["TRAINER_WORKERS"])


def _has_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not _has_compose(), reason="no `docker compose` here (the structure is checked above)")
def test_docker_compose_config(tmp_path):
    (tmp_path / ".env").write_text(
        (REPO / ".env.example").read_text().replace("POSTGRES_PASSWORD=\n", f"POSTGRES_PASSWORD={TEST_PASSWORD}\n")
    )
    res = subprocess.run(
        [
            "docker",
            "compose",
            "-f",
            str(REPO / "docker-compose.yml"),
            "--env-file",
            str(tmp_path / ".env"),
            "config",
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


def test_ports_are_published_on_this_host_only_by_default():
    """PostgreSQL, MLflow and optuna-dashboard were once published on every interface. Now on BIND_ADDRESS,
    127.0.0.1 in the template and when the variable is not set at all."""
    env = filled_env()
    assert env["BIND_ADDRESS"] == "127.0.0.1"
    unset = {k: v for k, v in env.items() if k != "BIND_ADDRESS"}
    for name, svc in SERVICES.items():
        for port in svc.get("ports", []):
            assert port.startswith("${BIND_ADDRESS:-127.0.0.1}:"), (name, port)
            assert interpolate(port, env).startswith("127.0.0.1:") and interpolate(port, unset).startswith("127.0.0.1:")
            assert interpolate(port, {**env, "BIND_ADDRESS": "0.0.0.0"}).startswith("0.0.0.0:")  # the way out
    for svc in yaml.safe_load((REPO / "docker" / "compose.gpu.yml").read_text())["services"].values():
        assert "ports" not in svc


def test_the_database_password_is_required_and_has_no_default():
    """The template's password was `change-me`, and a stack started with it. Now the template has none, and every use of
    the variable stops compose with a message while it is empty or unset."""
    env = env_example()
    assert env["POSTGRES_PASSWORD"] == ""
    uses = [m for m in VAR.finditer(compose_text()) if m.group(1) == "POSTGRES_PASSWORD"]
    assert len(uses) == 4 and all(m.group(2) == ":?" and "POSTGRES_PASSWORD" in m.group(3) for m in uses)
    for name in ("postgres", "mlflow", "optuna-dashboard", "trainer"):
        with pytest.raises(Refused, match="set POSTGRES_PASSWORD in .env"):
            interpolate(repr(SERVICES[name]["environment"]), env)
        interpolate(repr(SERVICES[name]["environment"]), filled_env())
    for path in (REPO / "docker-compose.yml", REPO / ".env.example", REPO / "docs" / "sweeps.md", REPO / "README.md"):
        assert "change-me" not in path.read_text(), path


def test_the_docs_say_how_to_expose_the_stack_behind_a_login():
    docs = (REPO / "docs" / "sweeps.md").read_text()
    section = docs[docs.index("### Exposure and logins") :]
    for piece in (
        "BIND_ADDRESS",
        "--app-name basic-auth",
        "MLFLOW_AUTH_ADMIN_PASSWORD",
        "MLFLOW_TRACKING_USERNAME",
        "reverse proxy",
        "optuna-dashboard",
    ):
        assert piece in section, piece


def test_postgres_init_script_creates_the_sweeps_database():
    """Run docker/postgres/init-sweeps.sh as the image would, against the local PostgreSQL server."""
    import uuid

    if shutil.which("psql") is None:
        pytest.skip("psql not installed")
    psycopg2 = pytest.importorskip("psycopg2")
    try:
        conn = psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="test", connect_timeout=5)
    except psycopg2.OperationalError as err:
        pytest.skip(f"PostgreSQL unreachable at 127.0.0.1:5432: {err}")
    conn.autocommit = True
    name = f"mhc_init_{uuid.uuid4().hex[:8]}"
    env = {
        "PATH": "/usr/bin:/bin:/usr/local/bin",
        "PGHOST": "127.0.0.1",
        "PGPORT": "5432",
        "POSTGRES_USER": "postgres",
        "POSTGRES_DB": "test",
        "SWEEPS_DB": name,
    }
    try:
        res = subprocess.run(
            ["sh", str(REPO / "docker" / "postgres" / "init-sweeps.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        with conn.cursor() as cur:
            cur.execute("select 1 from pg_database where datname = %s", (name,))
            assert cur.fetchone() == (1,)
    finally:
        with conn.cursor() as cur:
            cur.execute(f'drop database if exists "{name}"')
        conn.close()
