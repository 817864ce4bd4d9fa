"""Capture: record a running PyTorch program's allocations, collectives and scopes as a schema-1 trace.

Turned on by the environment (``HAZSAN=1``) through the bootstrap line in hooks/hazsan_capture.pth,
in this process and every process it starts. Modules, in the order they come into play:

  config        settings from HAZSAN_* variables
  bootstrap     activate(): post-import hooks for torch / torch.distributed / SGLang, atexit, signals, fork
  signals       SIGTERM / SIGINT / SIGHUP: flush (or close) in front of the program's own handler
  runtime       the per-process Capture: writer, scopes, steps (and their ends), hook-failure accounting
  sites         call sites outside torch and hazsan
  memory        TorchDispatchMode + storage finalizers -> alloc / free
  allocator_history  HAZSAN_ALLOC_SOURCE=history: the CUDA caching allocator's record -> segments, checks
  window        CPU model of symmetric windows (placement by sanitizer.place)
  collectives   torch.distributed wrappers -> coll / coll_done
  compiled      torch.compile: the wait AOTAutograd performs on an AsyncCollectiveTensor while compiling
  torch_hooks   installs the above when torch is imported; torch.cuda.use_mem_pool on window pools
  sglang_hooks  SGLang's SymmetricMemoryContext (scopes, pool windows) and Scheduler.run_batch
  nccl          NCCLLibrary (SGLang's and vLLM's pynccl): coll / segment / window per ctypes call
  ops           SGLang's non-NCCL collective kernels (custom AR, quick AR, symm-mem AR, MSCCL++, multimem AG)
  facts         the trace header's hooks, versions and device facts
  gpu_selfcheck_nccl  `python -m sanitizer.capture.gpu_selfcheck_nccl`: the NCCL capture on a real GPU

This package imports nothing heavy at import time; torch is imported only by the modules that run
after the program imported it.
"""
