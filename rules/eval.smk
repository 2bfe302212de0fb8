rule eval_run:
    input:
        problems="results/data/heldout.jsonl",
        base=BASE_MODEL,
        adapter="results/{arm}/seed{seed}/adapter",
        src=code_inputs("evaluate.py"),
    output:
        "results/{arm}/seed{seed}/{kind}.json",
    log:
        "results/logs/eval/{arm}_seed{seed}_{kind}.log",
    benchmark:
        "results/benchmarks/eval/{arm}_seed{seed}_{kind}.tsv"
    conda:
        "../envs/talkmethods.yaml"
    threads: 2
    resources:
        gpu=1,
    params:
        eval=tm_config.eval_params(config),
    script:
        "../workflow_scripts/evaluate.py"


# base x base, once: eval_run with neither seat on an adapter (the script reads kind "base" from the missing wildcard)
use rule eval_run as eval_base with:
    input:
        problems="results/data/heldout.jsonl",
        base=BASE_MODEL,
        src=code_inputs("evaluate.py"),
    output:
        "results/base/eval.json",
    log:
        "results/logs/eval/base.log",
    benchmark:
        "results/benchmarks/eval/base.tsv"


# eval.one_job_per_run: a run's kinds in one job, one process start instead of three (each ~33 s on an
# H100 beside 17.6 s of play); `snakemake results/raft/seed17/eval.json` then plays all three
if config["eval"]["one_job_per_run"]:

    use rule eval_run as eval_run_kinds with:
        output:
            [f"results/{{arm}}/seed{{seed}}/{kind}.json" for kind in EVAL_KINDS],
        log:
            "results/logs/eval/{arm}_seed{seed}_kinds.log",
        benchmark:
            "results/benchmarks/eval/{arm}_seed{seed}_kinds.tsv"

    ruleorder: eval_run_kinds > eval_run
