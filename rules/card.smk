rule aggregate:
    input:
        evals=expand(
            "results/{arm}/seed{seed}/{kind}.json",
            arm=ARMS,
            seed=SEEDS,
            kind=EVAL_KINDS,
        ),
        logs=expand("results/{arm}/seed{seed}/train_log.jsonl", arm=ARMS, seed=SEEDS),
        base="results/base/eval.json",
        selftest="results/selftest.json",
        split_stats="results/data/split_stats.json",
        src=code_inputs("aggregate.py"),
    output:
        csv="results/summary.csv",
        json="results/summary.json",
    log:
        "results/logs/aggregate.log",
    conda:
        "../envs/talkmethods.yaml"
    params:
        arms=ARMS,
        seeds=SEEDS,
        n_boot=config["stats"]["n_boot"],
        alpha=config["stats"]["alpha"],
    script:
        "../workflow_scripts/aggregate.py"


rule train_curve:
    input:
        log="results/{arm}/seed{seed}/train_log.jsonl",
        src=code_inputs("train_curve.py"),
    output:
        report(
            "results/{arm}/seed{seed}/train_curve.png",
            category="Training curves",
            subcategory="{arm}",
            labels={"arm": "{arm}", "seed": "{seed}"},
        ),
    log:
        "results/logs/curve/{arm}_seed{seed}.log",
    conda:
        "../envs/talkmethods.yaml"
    script:
        "../workflow_scripts/train_curve.py"


rule card:
    input:
        curves=expand("results/{arm}/seed{seed}/train_curve.png", arm=ARMS, seed=SEEDS),
        summary="results/summary.json",
        selftest="results/selftest.json",
        split_stats="results/data/split_stats.json",
        src=code_inputs("card.py"),
    output:
        md=report("results/card.md", category="Card"),
        png=report("results/card.png", category="Card", caption="../report/card.rst"),
    log:
        "results/logs/card.log",
    conda:
        "../envs/talkmethods.yaml"
    params:
        meta={
            "model": config["model"]["name"],
            "data": config["data"]["source"]
            + (
                f" ({config['data']['local_dir']})"
                if config["data"]["local_dir"]
                else ""
            ),
            "offline": config["model"]["name"] == "offline-tiny-qwen2",
            "world": (
                f"{config['data']['world']} (generated)"
                if config["data"]["source"] == "generated"
                else None
            ),
            "warmstart": config["model"]["warmstart"],
            "prompt": config["data"]["prompt"],
            "recipe": {
                **config["train"],
                **tm_recipe.TRL_FIXED,
                "arms": ARMS,
                "seeds": SEEDS,
                "eval": config["eval"],
            },
        },
    script:
        "../workflow_scripts/card.py"
