"""``hybrid.megatron_import``: megatron-core imported without TorchDynamo and Inductor, and its
``torch.compile``-decorated kernels still compiled, on their first call, by the real one."""

import subprocess
import sys

import pytest

from hybrid.megatron_import import compile_deferred, deferred_compile

pytestmark = pytest.mark.timeout(120)


def test_a_worker_fork_servers_imports_load_no_compiler():
    """What the fork server preloads (``WORKER_PRELOAD``): megatron-core's layers and datasets
    are there, Inductor's compiler and Dynamo's repro tools (what megatron's decorators
    imported) are not, and ``torch.compile`` is torch's own again."""
    from launch.launchers.fork_server import WORKER_PRELOAD

    code = ("import sys, importlib, torch\n"
            f"for name in {list(WORKER_PRELOAD)!r}: importlib.import_module(name)\n"
            "from hybrid.data.megatron import _config\n"
            "import megatron.core.datasets.gpt_dataset, megatron.core.fusions.fused_bias_geglu\n"
            "print(sorted(m for m in ('torch._inductor.compile_fx', 'torch._dynamo.repro')"
            " if m in sys.modules),"
            " torch.compile.__module__, 'megatron.core.tensor_parallel' in sys.modules)")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]", "torch", "True"]


def test_a_deferred_function_is_compiled_once_on_its_first_call_with_its_options():
    compiled = []

    def real(fn, **options):
        compiled.append((fn.__name__, options))
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    class FakeTorch:
        compile = real

    with compile_deferred(FakeTorch):
        @FakeTorch.compile
        def plain(x):
            return x + 1

        @FakeTorch.compile(dynamic=False)
        def with_options(x, *, y):
            return x * y

    assert FakeTorch.compile is real and compiled == []  # restored; nothing compiled yet
    assert plain.__name__ == "plain"
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert with_options(2, y=3) == ("compiled", 6)
    assert compiled == [("plain", {}), ("with_options", {"dynamic": False})]


def test_the_stand_in_is_restored_when_the_import_fails():
    class FakeTorch:
        compile = staticmethod(deferred_compile(lambda fn: fn))

    real = FakeTorch.compile
    with pytest.raises(ImportError):
        with compile_deferred(FakeTorch):
            raise ImportError("megatron-core missing")
    assert FakeTorch.compile is real
