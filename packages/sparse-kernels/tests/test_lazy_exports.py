"""The package loads its exports on first use: the config alone comes without torch."""

from leanlm_testing.exports import check_lazy_exports, run_python


def test_the_config_loads_without_torch():
    out = run_python(
        "import sys\n"
        "from sparse_kernels import SparsityConfig\n"
        "SparsityConfig(pattern='2:4')\n"
        "try:\n"
        "    SparsityConfig(pattern='5:4')\n"
        "except ValueError:\n"
        "    print('checked')\n"
        "print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))\n"
    )
    assert out == ["checked", "[]"]


def test_every_export_resolves_to_its_module_s_object():
    import sparse_kernels

    # `masks` is a submodule and the exported function: the function, as eager imports gave
    check_lazy_exports(sparse_kernels, {"masks": "sparse_kernels.sparsify"}, ("masks", "nm_mask"))
