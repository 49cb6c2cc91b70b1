# The evidence archive: evidence/index.html and a page per evidence directory in evidence/_pages/
# (workflow/stages/archive.py, workflow/archive/pages.py), plus what `snakemake --report report.html` shows.


report: "../report/workflow.rst"


# The campaign's key outputs, each with its caption. They are marked for the report here, as inputs of
# an always-defined rule, and not on their stage rules: a sealed directory's stage rules are not
# defined (Snakefile), and a report is made after the run, when the directory is sealed. A directory
# sealed by an older version may lack a newer stage's file; it is then left out of the report.
REPORTED = {  # name: (path, caption, category, the stage that writes it; None: every campaign)
    "summary": (f"{E}/{layout.SUMMARY}", "summary.rst", "Evidence", None),
    "details": (f"{E}/{layout.DETAILS}", "details.rst", "Evidence", None),
    "manifest": (f"{E}/{layout.MANIFEST}", "manifest.rst", "Evidence", None),
    "parity": (f"{E}/{layout.COMPARISON}", "parity.rst", "Parity", "parity"),
    "bench_table": (f"{E}/{layout.BENCH_TABLE}", "bench-table.rst", "Benchmark", "bench"),
    "bench_plot": (f"{E}/{layout.BENCH_PLOT}", "bench-plot.rst", "Benchmark", "bench"),
    "overlap_screen": (f"{E}/{screens.files(screens.BUILTIN)['screen']}", "overlap-screen.rst", "Overlap", "overlap"),
    "overlap_plot": (f"{E}/{screens.files(screens.BUILTIN)['plot']}", "overlap-plot.rst", "Overlap", "overlap"),
    "kernel_audit": (f"{E}/{layout.AUDIT}", "kernel-audit.rst", "Kernels", "kernel_audit"),
    "quality_gate": (f"{E}/{layout.QUALITY_GATE}", "quality-gate.rst", "Quality", "quality"),
    "profile_plot": (f"{E}/{layout.PROFILE_PLOT}", "profile-plot.rst", "Profile", "profile"),
    **{f"overlap_{e['name']}_{kind}": (f"{E}/{screens.files(e['name'])[kind]}", f"overlap-{kind}.rst", "Overlap", "overlap")
       for e in config["screens"] for kind in ("screen", "plot")},
}
ARCHIVE_INPUTS = {
    name: report(path, caption=f"../report/{caption}", category=category)
    for name, (path, caption, category, stage) in REPORTED.items()
    if (stage is None or stage in config["stages"]) and (not SEALED or os.path.exists(path))
}
INDEX = "evidence/index.html"


# The whole archive (every campaign, every id) is rewritten, but only when this campaign's directory
# is newly sealed: its inputs are files of that directory, so an unchanged tree has nothing to do. Under a
# cluster executor it runs where Snakemake runs, not as a cluster job.


localrules:
    archive,


rule archive:
    input:
        **ARCHIVE_INPUTS,
    output:
        INDEX,
    resources:
        **job_resources(),
    params:
        py=PY,
        tracking="--tracking-uri '{}'".format(config["tracking"]["uri"]) if config["tracking"]["uri"] else "",
    log:
        f"{SEAL_LOGS}/archive.log",
    benchmark:
        f"{SEAL_LOGS}/archive.benchmark.tsv"
    shell:
        "{params.py} -m evident.workflow.stages.archive --out {output} {params.tracking} 2>&1 | tee {log}"
