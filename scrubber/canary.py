"""The canary test of the GPU wipe: child programs that plant a marker in GPU memory and look for it.

``FILL`` takes (almost) all free memory of GPU 0, writes high-entropy words with the marker
every 512th word, prints ``<filled bytes> <total bytes>`` and sleeps (the caller SIGKILLs it
holding the memory, as a crashed job would). ``SCAN``, a later process, allocates what it can
and prints ``<hits> <scanned bytes>``: a hit is a marker word still readable. Without a wipe in
between the marker is found (the negative control); after the epilog's wipe it must not be.

Run each as its own process (``python -c`` with ``textwrap.dedent``): ``tests/gpu/test_gpu_wipe.py``
and ``bench/gpu.py`` do. Only text here, nothing runs on import.
"""

FILL = """
    import sys, time, torch
    from scrubber.gpu import fill
    marker = int(sys.argv[1], 16) - (1 << 63)  # as a signed int64
    chunks = fill(torch, 0, 0)
    g = torch.Generator(device="cuda").manual_seed(7)
    filled = 0
    for t in chunks:
        words = t.view(torch.int64)
        words.random_(generator=g)  # high entropy: nothing compressible, no run of zeros
        words[::512] = marker
        filled += t.numel()
    torch.cuda.synchronize()
    print(filled, torch.cuda.get_device_properties(0).total_memory, flush=True)
    time.sleep(600)
"""

SCAN = """
    import sys, torch
    marker = int(sys.argv[1], 16) - (1 << 63)
    chunks, size = [], 1 << 30
    while size >= 2 << 20:  # uninitialised: whatever the previous owner left
        try:
            chunks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError:
            size //= 2
    hits = scanned = spare = 0
    while chunks and spare < (256 << 20):  # the smallest chunks, checked on the host, make room
        t = chunks.pop()
        hits += int((t.cpu().view(torch.int64) == marker).sum())
        scanned += t.numel()
        spare += t.numel()
        del t
    torch.cuda.empty_cache()
    step = 8 << 20  # int64 words per comparison
    for t in chunks:
        w = t.view(torch.int64)
        for i in range(0, w.numel(), step):
            hits += int((w[i:i + step] == marker).sum())
        scanned += t.numel()
    print(hits, scanned, flush=True)
"""
