"""The package loads its exports on first use: `DistillConfig` alone comes without torch."""

from leanlm_testing.exports import check_lazy_exports, run_python


def test_distill_config_loads_without_torch():
    out = run_python(
        "import sys\n"
        "from prune_distill import DistillConfig\n"
        "DistillConfig(temperature=2.0, hidden_loss_weight=1.0)\n"
        "try:\n"
        "    DistillConfig(temperature=0.0)\n"
        "except ValueError as err:\n"
        "    print('checked' if '`temperature`' in str(err) else err)\n"
        "print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))\n"
    )
    assert out == ["checked", "[]"]


def test_every_export_resolves_to_its_module_s_object():
    import prune_distill

    # submodules named like exported functions: the functions, as eager imports gave
    check_lazy_exports(
        prune_distill,
        {
            "distill": "prune_distill.distill",
            "prune": "prune_distill.prune",
            "search": "prune_distill.search",
        },
        ("search", "candidates"),
    )
    assert prune_distill.distill is prune_distill.distill.__globals__["distill"]
    # the old home of DistillConfig still has it
    assert prune_distill.distill.__globals__["DistillConfig"] is prune_distill.DistillConfig
