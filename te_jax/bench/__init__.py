"""`python -m te_jax.bench`: te_jax side by side with the other attention implementations a JAX user could pick, on the
same inputs, in the same process (or one process per backend with --isolate), timed the same way.

Modules, one thing each: cases (what is measured), presets (sweeps of cases), flops (the FLOP model), inputs
(deterministic inputs and their rotation sets), registry (the backend interface, capabilities and "why not"),
backends_jax / backends_torch (the implementations), availability (proving a backend works by running it),
accuracy (errors against the float64 reference), timing (how calls are timed), runner (a sweep in this process),
isolate (a sweep with one process per backend), results (result rows and speedups), table / files / plot (output),
progress (the progress bar), worker (the --isolate child process), kernel_root (--kernel-root: another tree's CUDA
kernels), paging (the paged backends' page pool), __main__ (the command line).
"""
