# One named target per arm: `snakemake -j1 arm_raft` trains and evaluates all of raft's seeds.
for _arm in ARMS:

    rule:
        name:
            f"arm_{_arm}"
        input:
            expand(
                "results/{arm}/seed{seed}/{kind}.json",
                arm=_arm,
                seed=SEEDS,
                kind=EVAL_KINDS,
            ),
