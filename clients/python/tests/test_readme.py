"""The README's Python blocks run as written, in order, against the real
server (its address substituted for ``idempotency:50051``)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import Server

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_examples_run(server: Server, capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    assert len(blocks) >= 6
    namespace: dict = {}
    for block in blocks:
        exec(compile(block.replace("idempotency:50051", server.target), str(README), "exec"), namespace)
    out = capsys.readouterr().out
    # The ASGI example answers a request, then replays it.
    from test_asgi import call

    first = call(namespace["app"], key="readme-asgi-key-1", headers=((b"x-user-id", b"u1"),))
    again = call(namespace["app"], key="readme-asgi-key-1", headers=((b"x-user-id", b"u1"),))
    assert first[0] == again[0] == 201 and again[1]["idempotent-replayed"] == "true"
    assert call(namespace["app"], key=None)[0] == 400

    assert "answer 201 b'pay_1' \n" in out
    assert '{"a":9007199254740993,"b":[1e+21,0.1]}' in out
    assert "id.key INVALID_ARGUMENT" in out
    assert "RecordState.COMPLETED" in out


def test_the_main_readmes_python_section_runs(server: Server, capsys) -> None:
    main = README.parents[2] / "README.md"
    blocks = [block for block in re.findall(r"```python\n(.*?)```", main.read_text(encoding="utf-8"), re.DOTALL)
              if "idempotency_client" in block]
    if not blocks:
        import pytest

        pytest.skip("the repository's README has no Python example")
    for block in blocks:
        exec(compile(block.replace("idempotency:50051", server.target), str(main), "exec"), {})

    # The quickstart's key may already be stored by the other README's run.
    assert re.search(r"Outcome\.(EXECUTED|REPLAYED) 201", capsys.readouterr().out)
