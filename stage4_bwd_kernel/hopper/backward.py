"""Stage 4, Hopper step 3: P^T and dS^T stay in registers (RS wgmma); a dQ writer warp does the reduction.

Compared with the previous step, this adds **register-sourced dV/dK GEMMs with the keys split
across the two consumer warpgroups**, and **a dQ writer warp that reduces each dQ tile into
global memory with the TMA unit (``cp.reduce.async.bulk ... add.f32``) from a double-buffered
shared-memory tile**, because step 2 is shared-memory bound (every operand of all five GEMMs is
read from SMEM, and P^T goes through SMEM too) and its math warpgroups stall on 4096 fp32 atomics
-- and, in deterministic mode, on the semaphore -- after every Q tile.

(a) RS operands. S^T = K Q^T and dP^T = V dO^T now split M (keys) between the warpgroups: consumer
    w owns keys [64 w, 64 w + 64) of the 128-key tile, so its S^T / dP^T accumulator rows are its
    own keys. dV += P^T dO and dK += dS^T Q have those same keys as M, so each warpgroup converts
    its P^T and dS^T accumulators in place into 16-bit A-operand fragments (the accumulator and
    the A fragment of a 64 x N wgmma hold the same (row, column) pairs in the same register order,
    as in the forward's P V, stage3 ``hopper_step4_fa4_softmax``) and issues wgmma with A from
    registers (``warpgroup.OperandSource.RMEM``). Only dS goes to SMEM (dS^T rows, read MN-major
    as the A of dQ = dS K, whose N = d the warpgroups still split).

    SMEM cycles per 64 x 128 tile at d = 128 on an H100 (``roofline.hopper_tile_cycles``: 128 B/clk,
    every 64-row wgmma block re-reads its B slice, A from SMEM read once per warpgroup that needs it):

        step 2 (all SS, N split)             operands 3072 + P^T, dS^T writes 256     = 3328 clk
        step 3 (S^T, dP^T M split; dV, dK RS) operands 2048 + dS^T write 128           = 2176 clk
                + dQ through SMEM: 64 x 128 fp32 written (256) and read by the TMA (256) = 2688 clk
        tensor cores: 10 * 64 * 128 * 128 / 4096                                     = 2560 clk

    so the tile goes from SMEM-bound (3328 vs 2560, 1.30x) to balanced (2688 vs 2560, 1.05x).
    d = 64: 2176 -> 1280 + 256 = 1536 (MMA 1280); d = 96: 2752 -> 1728 + 384 = 2112 (MMA 1920).

    Registers per consumer thread (fp32 accumulators; 128 threads x 64 keys per warpgroup; the 64 x 128
    tile -- d = 64 runs 128 x 128, see "Tiles" at the end):
    dK 64 d / 128 = d/2, dV dv/2, S^T and dP^T 64 * 64 / 128 = 32 each, the 16-bit P^T fragment 16
    (live while dV reads it), dQ 64 * (d/2) / 128 = d/4. Peak while dS^T is formed, d = 128:
    64 + 64 + 32 + 32 + 16 = 208 of the 240 that ``setmaxnreg`` gives a consumer (FA3 runs the same
    64 x 128 tile, 2 math warpgroups, S^T "swapAB" and RS dK/dV for its causal d = 128 backward, and
    64 x 128 for d = 96 -- note from flash-attention's ``hopper/flash_bwd_launch_template.h``;
    nothing of its code is used here). d = 96: 48 + 48 + 32 + 32 + 16 = 176; d = 64: 144.
    **(192, 128) and (256, 256) do not fit**: (192,128) needs 96 + 64 + 32 + 32 + 16 = 240 for the
    data alone (no room for addresses, masks, loop state), and a smaller tile_m cannot help because
    dQ = dS K needs tile_m >= 64 (wgmma M); (256,256) needs dK + dV = 128 + 128 = 256 > 240 before
    anything else. They raise ValueError here (step 1 serves them).

(b) dQ off the math warps (as first built; ``dq_frag``, the eleventh option below and the default in all
    but causal deterministic d = 128, hands dQ off in fragment order). After its dQ wgmma a consumer
    thread stores its dQ fragment (fp32, 8-byte stores) into sdQ[t % 2] -- a 128-byte-swizzled (tm, d)
    tile (64-byte spans at d = 96), so the 8
    rows of one warp store land in 8 different bank groups (conflict-free) and the TMA unit can read
    it -- fences the generic->async proxy and *arrives* on the named barrier "dQ full[b]"; it does
    not wait. Warp 1 of the producer warpgroup (the dQ writer) waits on "dQ full[b]", and one of its
    lanes (elected inside the TMA copy) issues one TMA tensor reduce-add per warpgroup's share of the
    tile (``cp.reduce.async.bulk.tensor ... add``, SASS ``UTMAREDG``, one per swizzle span; rows past
    seqlen_q lie outside the tensor and are skipped), a commit, and ``cp.async.bulk.wait_group.read
    0``; then the warp *arrives* on "dQ empty[b]", which the consumers wait on before they overwrite
    sdQ[b] two tiles later. So the
    math warpgroups run up to one tile ahead of the reduction. Varlen: the last tile of a sequence
    also adds into the next sequence's first rows -- exactly +-0 (those queries' P, dS and dQ are
    0), which leaves every value, and deterministic mode's bits, unchanged (a sum of signed zeros
    has the same sign in any order). Deterministic mode moves the semaphore protocol of
    ``common.py`` to the writer: lane 0 spins until the tile's counter equals this CTA's rank
    (``schedule.py``'s orders, unchanged), issues the reduce, waits for its *completion*
    (``cp.async.bulk.wait_group 0``), fences the async proxy, and releases. (The +-0 argument
    assumes finite inputs: an inf in the next sequence's dO would turn those zeros into NaN.)

    (An earlier version issued one row-wise ``cp.reduce.async.bulk`` of d * 4 bytes per query row:
    64 per tile. On the H100 the writer then fell behind whenever the CTAs added into different dQ
    tiles -- every causal run: 32% of the consumers' stall samples sat on "dQ empty" and a causal
    tile step cost 1.75x a non-causal one; ``benchmarks/probe_bwd_walk.py``, stage 4 README.)

Barriers (named, hardware ids; 0 is __syncthreads, used only before the role split):
    1        the 256 consumer threads: B1 per tile (lse2/D rows in SMEM, and both warpgroups are past
             the previous tile's dQ wgmma, so sdS may be overwritten), B2 per tile (both halves of
             dS^T in SMEM before the dQ wgmma), and the epilogue's
    2, 3     dQ full[0/1]: 256 consumer arrivals + the writer warp's sync = 288
    4, 5     dQ empty[0/1]: the writer warp's arrival + 256 consumer syncs = 288. Tile t waits
             "empty" only when t >= 2 and the writer arrives only when t + 2 < tiles, so every
             barrier generation completes and none is left half-arrived at exit. With one dQ
             buffer (80 x 128) "full" is 2 and "empty" 3, tile t waits when t >= 1 and the writer
             arrives when t + 1 < tiles.
    Decoupled warpgroups (``decoupled``, the default on every tile; see the end): B1 becomes each
    warpgroup's own (2 + w, 128 threads), "sdSt free" barriers (4 + w) take over its guard of sdSt
    where dS^T has one buffer (d = 64; with two, B2 suffices: ``ds_buffers``), "dQ full[b]"
    is 6 + b (288, as above), and "dQ empty" is per buffer and warpgroup (6 + buffers + 2 b + w, 160
    threads: the writer's arrival + one warpgroup's sync).
Q/dO/K/V: step 2's TMA producer warp and mbarrier ring, unchanged (inherited).

Per tile (t) of a consumer warpgroup, wgmma groups committed in this order (with ``stats_tma``, the
default since, the bracketed statistics steps are gone: lse2 / D arrive with Q_i / dO_i):
    S^T (SS) ; dP^T (SS) ; [lse2/D registers -> SMEM, B1] ; lse2/D of tile t + 1 -> registers
    wait S^T ; P^T ; dV += P^T dO (RS) ; wait dP^T ; dS^T ; dS^T -> SMEM ; [B2]
    dQ = dS K (SS) ; dK += dS^T Q (RS) ; wait all but dK ; release dO_i ; [t >= 2: wait dQ empty[t%2]]
    dQ -> sdQ[t%2] ; arrive dQ full[t%2] ; wait dK ; release Q_i
The row statistics are loaded one tile ahead (the global load of 2 x 64 floats used to sit between
the S^T issue and B1, with all 256 consumers waiting at B1: 18% of the kernel's stall samples at
d = 128), and dQ goes before dK so its hand-off to the writer runs under dK.
Tiles that need no mask (most of them) run a copy of this body compiled without the mask test:
the walk is cut into three segments, masked / mask-free / masked (``schedule.unmasked_m_range``).
Measured on the H100 at d = 128 (stage 4 README): 0.79-0.83x of the official FA4 before these
changes and the warp-uniform descriptors below, 0.94-1.01x after.

Shared memory (bf16, 2 Q/dO stages, 2 dS^T buffers below 128 queries and 2 dQ buffers where they
fit; default tiles, see "Tiles"):
    K + V + 2 (Q + dO) + dS^T buffers + dQ buffers (fp32, swizzled, no padding)
    d = 64  (128 x 128):  16 + 16 + 2 * 32 + 1 * 32 + 2 * 32 = 192 KB   (the 64 x 128 tile: 112 KB)
    d = 96  (64 x 128):   24 + 24 + 2 * 24 + 2 * 16 + 2 * 24 = 176 KB
    d = 128 (80 x 128):   32 + 32 + 2 * 40 + 2 * 20 + 1 * 40 = 224 KB   (of 227; two dQ buffers: 264)

Compiled (sm_90a, bf16/fp16, causal and deterministic on/off, varlen, this ptxas): 0 spills, no
local memory, all 16 named barriers reserved (ids computed at run time, see "decoupled"); shared
memory 199680 / 182272 / 231424 bytes at d = 64 / 96 / 128; HGMMA per tile 32 / 28 / 34 (16 / 8 / 10 of
them register-sourced), in each of the three copies of the tile body;
UTMAREDG 8 / 6 / 4 (32-byte spans at d = 64, see below); no fp32 REDG. The consumers' wgmma descriptors live in uniform registers (their
shared-memory operands are sliced by the warpgroup's first thread, marked warp-uniform): 535 SASS
instructions per mask-free tile and warp at d = 128, against 698 with per-thread descriptors and the
mask test in every tile. ptxas must not serialize any wgmma (the compile tier checks its log): a
runtime ``if`` around the mask inside the body did that at d = 64 (C7520), and so did issuing the
next tile's S^T before this tile's dQ wait (C7514: the in-flight accumulator crosses the loop's
back edge) -- the official kernel also drains its wgmmas inside each iteration.
``setmaxnreg`` 24 / 240 / 240: the three must sum to 3 x 168, the registers the CTA was launched
with -- ``setmaxnreg.inc`` only takes what ``.dec`` released in the same CTA, so 32 / 240 / 240
(65536 > 64512), tried for a writer-side varlen tail loop, hung on the H100.
Tiles: 64 x 128 at d = 96 (step 2's); **80 x 128 at d = 128** (below); **128 x 128 at d = 64** (FA3's and the official FA4's
d = 64 tile): the better SMEM/MMA ratio (2816 / 2560 = 1.10 vs 1536 / 1280 = 1.20) and half the
per-tile overheads (barriers, hand-offs, row statistics) per unit of work. Its S^T and dP^T take
64 registers each, and in the 64 x 128 order (dV issued before dS, dQ split by columns) the tile
spilled 172 bytes and ptxas serialized its wgmmas (C7512). Three changes fit it under 240, each
a constructor option that defaults on for tile_m = 128 (late_dv also for 80, below):

* ``late_dv``: dS^T is formed right after the dP^T wait, P^T is packed to 16 bits only after
  that, and dV is issued after the dS^T stores (the official kernel's order), so the fp32 P^T, its
  16-bit copy and dP^T are never all live: peak 64 + 64 + 32 + 32 (+ 32 while packing) instead of
  64 + 64 + 32 + 32 + 32 with an in-flight dV holding its A registers. The row statistics of the
  next tile are loaded after the dQ wait instead of after B1 (their 2 registers then skip the peak).
  At 64 queries (d = 96), where the registers fit either way, it is the causal default only: on
  decoupled warpgroups with two dS^T buffers it measured +1..+7% causal and -2..-6% non-causal at
  4k-16k in two paired runs (``ab_bwd_h100_run22_d96_options_not_kept.json``,
  ``ab_bwd_h100_run23_d96_late_dv_causal.json``).
* ``dq_split_m``: the dQ wgmma splits its 128 query rows between the warpgroups (64 rows, all d
  columns each) instead of its d columns: each warpgroup reads half of dS once instead of all of it.
* the epilogue's key offset / row count and the statistics' query offset live in SMEM (3 words)
  instead of registers live across the walk (varlen spilled 4-8 bytes without it).

A fourth option, ``dq_swizzle32`` (on with dq_split_m): sdQ in 32-byte swizzle spans. A warpgroup
now stores all 64 columns of its rows, and in a 128-byte span the XOR pattern puts rows r and r ^ 1
of one 8-byte store on the same banks: Nsight Compute counted 2 extra wavefronts per dQ store (34 M
of 406 M shared wavefronts). With 32-byte spans the 8 rows of a store are 8 consecutive 32-byte
rows, conflict-free; the writer issues 8 TMA boxes per tile instead of 2, off the critical path.
Paired rounds (``ab_bwd_h100_run10_dq_sw32.json``, ``..._run11_d64_swizzle32_default.json``): +1..+8%
and +3..+8% at d = 64, 8k / 16k, causal or not; at
d = 128 (80 x 128, 4-byte transposed stores that were conflict-free already) it lost 4-9%, so only
the d = 64 tile uses it.

A fifth, ``stats_shuffle`` (default on for tile_m = 128, i.e. d = 64; the official kernel's way for
its d = 64 tile): the row statistics lse2 / D of a Q tile are needed per *column* of S^T / dP^T, tm / 4
different ones per thread (32 at d = 64: 16 LDS.64 each for lse2 and D per tile). Each lane now keeps 4
of them in registers (one LDS.128 from a permuted sLSE2 / sD, ``stats_slot``) and fetches each one it
needs with a shfl.idx from the lane that holds it (``stats_shuffle_source``). Why it pays: with the
exp2 of the tile removed altogether (a diagnostic build, lse2 loads included) d = 64 ran 15-20% faster,
as fast as the official kernel; with the exp2 kept and only the lse2 loads removed, 3-6% faster
(``probe_bwd_h100_d64_phase_ablation.json``, ``..._exp_phase.json``): likely because LDS and MUFU
share the MIO instruction queue. Paired rounds: +0.4..+3.0% and, in an earlier build, +1..+5% at 8k / 16k
(``ab_bwd_h100_run12_stats_shuffle.json``). At d = 128 (tm = 80) ptxas serialized the wgmmas with it,
so that tile keeps the LDS.

Compiled: 0 spills, no serialization, every dtype / causal / deterministic / varlen combination.
On the H100 (both tiles in one process, ``tune_bwd_h100_run2_d64_128x128.json``) it is 4-18% faster
than the 64 x 128 tile at d = 64, 2k-16k, causal or not; run 6 (``bwd_h100_run6.json``) puts it at
0.93-1.02x of the official FA4, 4k-16k, against run 5's 0.86-0.90x with the 64 x 128 tile. (Runs
1-8 timed the official backward through ``.backward()``, which also accumulated ``.grad``: their
ratios read ~4-20% high; run 9 on is fair -- stage 4 README, "A correction".)

A sixth, ``decoupled`` (default on every tile, at d = 96 / 128 with ``ds_buffers``; the official kernel's
warpgroups work this way, read in its flash_bwd_sm90.py, no code used): the warpgroups meet once per
tile, at B2, instead of three times. Nsight Compute (``ncu_bwd_h100_d64_main_kernel.md``, "Phases") had both warpgroups
waiting for S^T together after B1, and the 288-thread "dQ empty" barrier locking them to each other
and to the writer. So:
* each warpgroup stages all tm rows of the statistics in its own copy of sLSE2 / sD and syncs only its
  own 128 threads (B1 per warpgroup); every read of the previous tile's copy precedes B2, which every
  writer of the next tile has passed;
* B1 also kept a warpgroup from storing the next tile's dS^T while the other's dQ wgmma still reads
  sdSt: now warpgroup w bar.syncs "sdSt free[w]" right before those stores (from its second tile on),
  and the other warpgroup bar.arrives on it as soon as its dQ wgmma has completed -- a tile earlier, so
  the sync almost never waits;
* sdQ holds each warpgroup's share of a tile (its 64 query rows) as a tile of its own, the writer
  reduce-adds the shares one TMA copy each, frees share 0 as soon as it has been read, and each
  warpgroup waits only for its own share to be free ("dQ empty[b][w]", 160 threads). "dQ full" stays
  one barrier per buffer: the consumers only arrive on it, and a warpgroup that is ahead cannot be a
  whole buffer ahead of the writer's wait anyway (B2). Per-warpgroup "full" barriers measured the
  same (runs 14 / 15 against run 18) and took 2 more ids.
Every barrier id is then computed at run time (``bar.sync`` takes it in a register), so ptxas
reserves all 16. Paired rounds at d = 64 (``ab_bwd_h100_run14_decoupled_d64.json``,
``..._run15_decoupled_early_empty.json``, ``..._run18_decoupled_shared_full_dq_buffers3.json``): +5..+7%
non-causal, +1..+5% causal, 8k / 16k. Three dQ buffers (232448 bytes of SMEM, exactly the 227 KB)
measured -1..+2% against two in run 18: not the default. At d = 128 (80 x 128, one dQ buffer) it first
lost 10-12% (``ab_bwd_h100_run14_decoupled_d128_not_kept.json``): Nsight Compute later showed why -- every
HGMMA of that build followed by a WARPGROUP.DEPBAR (``ncu_bwd_h100_d128_decoupled.md``), and its ptxas log
says C7512, "wgmma serialized due to insufficient register resources". The "sdSt free" barriers and
their conditions had pushed the 80-query tile, already at 228 of 240 registers, over the edge. With two
dS^T buffers those barriers go (next paragraph), the wgmmas run asynchronously again, and decoupling
pays there too. In deterministic mode both give the same bits (gpu tier) and the same speed within
-2..0% (``ab_bwd_h100_run17_decoupled_deterministic.json``), so one default serves both.

A seventh, ``ds_buffers`` (2 by default below the 128-query tile, i.e. d = 96 and 128; the official kernel
double-buffers dS at d = 128 too, which is where its last 20 KB of SMEM go -- read in its
flash_bwd_sm90.py, no code used): dS^T of tile t goes to buffer t % 2. A warpgroup stores tile t's dS^T
after passing B2 of tile t - 1, which the other warpgroup reaches only after its dQ wgmma of tile t - 2
(the last reader of that buffer) has completed, so the "sdSt free" barriers are not needed and B2 is the
only point where the warpgroups meet. Paired rounds, decoupled + two dS^T buffers against the coupled
default of the time, 8k / 16k (``ab_bwd_h100_run20_ds_buffers2.json``, ``..._run21_d96_ds_buffers2.json``,
``..._run21_d128_dq_full_per_wg.json``): d = 128 +4..+7%, causal or not, in both runs; d = 96 non-causal
+6..+7%, causal +2%. At d = 64 (decoupled already) two buffers measured -1..+4%, a tie, and would fill
the 227 KB exactly, so that tile keeps one.
Not kept: "dQ full" per warpgroup as well (``dq_full_per_wg``, 160-thread barriers, so the writer
reduces one warpgroup's share while the other still computes): -1..+1% at d = 128 against decoupled +
two dS^T buffers (run 21). Nor, on top of it at d = 96 (``ab_bwd_h100_run22_d96_options_not_kept.json``):
``stats_shuffle`` (-1..-9%); ``late_dv`` measured -2..-6% non-causal and +2..+7% causal, and with run 23
became the causal default there (see ``late_dv`` above).

An eighth, ``stats_tma`` (default on every tile; the official kernel loads its row statistics with the
producer too, read in its flash_bwd_sm90.py, no code used): the producer warp loads each Q tile's lse2 and
D with one 1-D TMA box each, on the Q and dO mbarriers, into a (tm, stages) ring; the consumers lose the
global loads a tile ahead, the SMEM staging stores and, decoupled, the per-warpgroup statistics barrier
(B1). Needs: rows of 16-byte multiples (the preprocess pads them) and, varlen, each sequence's statistics
starting 16-byte aligned (``common.stats_offset``: a box at an unaligned innermost start coordinate
faulted, illegal instruction, on the H100). Rows past the tensor land as 0 and are masked like the Q / dO
rows past a sequence. With stats_shuffle the lane's 4 values are queries q0, q0 + 1, q0 + 8, q0 + 9 of the
ordered ring (two LDS.64), q0 from a fresh %tid.x (kept live, the lane spilled the d = 64 tile). Paired
rounds against the consumer-loaded statistics, 8k / 16k (``ab_bwd_h100_run24_*_stats_tma.json``,
``ab_bwd_h100_run25_d64_stats_tma.json``): d = 128 +3..+6%, d = 64 +4..+11%, d = 96 causal +3% and
non-causal a tie.

Deterministic mode, three more (default on; they change no bit: the order of the adds is the order's).
Its cost was a chain: the CTAs of one (kv head, batch) add into each dQ tile one after another, and each
hop -- the writer's acquire, the TMA reduce, the wait for it to *land*, the release -- takes microseconds.
* ``sem_early`` (the ninth): the writer acquires tile t's semaphore before it waits for the consumers'
  tile, so the spin overlaps their math, and frees the buffer once the TMA has read it, before waiting for
  the adds to land. d = 64 non-causal, 1k-4k: 0.69-0.71x -> 0.69-0.75x of the default's speed.
* ``dq_writers`` (the tenth; default one writer warp per dQ buffer in deterministic mode, so 2 at d = 64 /
  96 and 1 at d = 128): warps 1 + w of the producer warpgroup take the tiles of buffer w, so two tiles'
  hops overlap. Each buffer's barriers still see one writer warp. d = 64 non-causal: +3..+11% on top.
* launch order (``schedule.KVAscendingSectionsOrder`` / ``KVDescendingSectionsOrder``, the deterministic
  defaults, see ``schedule._LaunchSections``): the chain's CTAs were launched side by side, so the k-th
  waited k hops before its first add, and every wave started side by side again. Launched in sections of
  about a wave, consecutive K/V tiles of a chain start G CTAs apart and the stagger carries over. At d = 64
  non-causal the sections hold two waves (``KVAscendingWideSectionsOrder``): the short tiles need the wider
  stagger, 0.86-0.94x -> 0.95-1.04x of the default at 1k-16k (runs 31-33); d = 128 lost 7-15% with it
  at 1k-4k (run 32: twice the bytes per head in L2), so it keeps one wave.
Time ratios to the default kernel in the same interleaved rounds (``ab_bwd_h100_run26_d64_sem_early.json``,
``..._run27_d64_det_writers.json``, ``..._run28_d64_det_sections.json``, ``..._run29_*_det.json``):

    d = 64 non-causal  1k / 2k / 4k / 8k   0.71 / 0.70 / 0.71 / 0.75 -> 0.92 / 0.91 / 0.92 / 0.89 (one-wave sections)
    d = 64 causal      2k / 8k             0.83 / 0.84 -> 0.94 / 1.03
    d = 128 non-causal 2k / 8k             0.80 / 0.95 -> 0.93 / 1.01
    d = 128 causal     2k / 8k             0.92 / 0.95 -> 0.93 / 1.02

Sections for the *non*-deterministic kernel measured -3..+4% (``..._run28_...``, ``..._run30_causal_sections.json``),
so it keeps blockIdx order. (A deferred release that acquires tile t + 1 before releasing tile t would
hide one more round trip, but then a CTA's release waits on its predecessor's next tile and the chain's
lag grows by a tile per CTA: not tried.)

The eleventh, ``dq_frag`` (the default except causal deterministic d = 128; the official kernel's
dQ hand-off, read in its flash_bwd_sm90.py, no code used): dQaccum in *fragment order*. Each consumer
thread stores its dQ registers as they are -- register i of thread t at float (i // 4) * 512 + t * 4 + i % 4
of its warpgroup's share, 16-byte STS, a warp's 512 bytes contiguous -- and the writer adds the whole share
(tm * d / 2 floats) into an equally ordered, contiguous chunk of a (B, H, rows, d) dQaccum with one 1-D
bulk reduce (``cp.reduce.async.bulk ... add.f32``, SASS UBLKRED); ``postprocess_frag`` asks this kernel's
dQ tiled MMA where each register belongs and writes dq. (Not the row-wise bulk reduces of the earlier
version above: 2 requests of 16 KB per tile at d = 64, not 64 of 256 bytes.) Why: in a single-wave grid,
where the CTAs of a head walk the Q tiles in lockstep and all add into the same dQ tile at once, step 3
at d = 64 spent 17% more per Q tile than the official kernel, and a build whose writer skipped the reduce
ran as fast as the official one (``walk_scan_h100_d64_dq_reduce.json``): the TMA tensor reduce of 32-byte
spans was the bottleneck. A new allocation is zeroed with torch (a memset) and the preprocess leaves it
alone. Paired rounds (``ab_bwd_h100_run35_d64_dq_frag.json`` .. ``..._run41_*``), speed relative to the
TMA tensor reduce: d = 64 non-causal +0..+6% at 1k-16k (deterministic +3%), d = 128 non-causal -0..+4%,
d = 96 at 4k +11% non-causal and +6% causal, d = 128 causal +3..+5%, d = 64 causal deterministic +6%,
d = 96 causal deterministic +2..+3% (``..._run46_*``), d = 128 causal deterministic -1..-2.5% (runs 41, 46;
so it keeps the tensor reduce). d = 64 causal in the default mode first *lost* 9-16%: ptxas serialized the wgmmas
of exactly that build (C7512, registers), and 8-byte stores, an address recomputed at the store or a
row of padding between tiles did not help; with ``stats_shuffle`` off it compiles clean and measured
+4..+5% (off alone: -0..-4%), so that build turns the shuffle off. Deterministic mode gives the same
bits either way (the same adds in the same order); ``test_dq_frag_either_way`` runs both.

**80 x 128 at d = 128** (the official kernel's non-causal d = 128 tile; FA3's before it): 25% more
work per tile for the same per-tile overheads, and N = 80 instead of 64 for S^T / dP^T. 80 is no
wgmma M, so the dQ GEMM is turned around, ``dq_swap_ab`` (default on when tile_m % 64 != 0):
dQ^T (d x tm) = K^T dS^T, A = K^T and B = dS as MN-major views of sK and sdSt, the warpgroups split
d (64 each, so d = 128 only). Its accumulator pairs are two adjacent *queries*, i.e. two rows of
sdQ: 4-byte stores into a transposed view, conflict-free under the 128-byte swizzle (the 4 query
rows of one store instruction XOR the 8 columns' 16-byte chunks apart). Registers: late_dv's order
again, peak 64 + 64 + 40 + 40 (+ 20 while packing). SMEM fits one dQ buffer (``dq_buffers``, chosen
from the budget): the writer has a whole tile's MMAs to read sdQ out before the next store. Paired
rounds on the H100 (``ab_bwd_h100_run4_tile_80x128.json``) against the 64 x 128 tile: +3..+12%
(causal included, so it is the default in every mode); run 9 (``bwd_h100_run9.json``): 0.90-1.02x of
the official FA4 at 4k-16k, run 10 (``bwd_h100_run10.json``, same d = 128 kernel) 0.90-1.03x.

The twelfth, ``q_shift`` (default for causal d = 128 in the default mode, dense): the 80-row Q tiles
are counted from the sequence's *end*. ``benchmarks/trace_bwd.py`` put this tile's cycles per query row
level with the official kernel's 64-row tile, yet the kernel walked 4.5% more rows than exist at 4k
causal: 128 / 80 is not whole, so one tile straddles each K/V tile's diagonal, and 4096 = 51 x 80 + 16
left the last tile of *every* walk 16 rows full. With ``top_padding(seqlen_q)`` rows of zeros before
query 0 (< 80, a multiple of 4 so the row statistics' TMA boxes stay 16-byte aligned) only the diagonal
tile is partial: 883 -> 858 tiles per 4k head. The kernel moves offset_q and seqlen_q by the padding
right after ``tile_bounds``; bottom-right causal alignment depends on their difference only, the TMA
loads past the tensor's start bring zeros (Q, dO, lse2, D: every product with them is zero), the dQ
tiles keep their place in dQaccum, and ``postprocess_frag`` skips the padding rows. Traced against
``~q_shift=0`` (``trace_bwd_h100_run5_*``): -2.5% CTA cycles at 4k, -1.1% at 8k. Needs dense tensors
(varlen would read the previous sequence), ``dq_frag`` and ``stats_tma``; deterministic mode keeps its
tiles.

The thirteenth, ``key_select`` (default for the 80-row tile outside deterministic mode): the unmasked
tile body also selects -inf for key rows past ``key_limit``. That never happens there: unmasked tiles
have every key, so the results are the same bits. What changes is ptxas's schedule.

* In the official kernel's cubin (kept on the device with ``CUTE_DSL_KEEP=cubin``) the hot loop has the
  instructions of ours, and 11 of a thread's 40 exponentials sit between the S^T wait and the dP^T wait.
  Those run while the dP^T wgmma does.
* Ours had 4 there. The rest ran after dP^T had finished, and the tensor cores idled until the dV wgmma.
* With the select (one FSEL per score, as the official loop has) ptxas keeps 13 ahead of the wait
  (``test_key_select_moves_exponentials_under_the_dp_wgmma`` counts them in the SASS).
* Traced on the H100 at 4k, all CTAs' cycles: -3.9% non-causal (0.867 G; the official kernel 0.882 G)
  and -3.4% causal (0.466 G; the official kernel 0.469 G); ``trace_bwd_h100_run8_*`` / ``..._run9_*``.
  ``same_outputs_bwd.py``: dk and dv bitwise equal to the build without it.
* At d = 64 the same select measured +0.4% (run 8), so the 128-row tile keeps its loop.
* Reading D before the dP^T wait as well (then 18 exponentials ahead of it at d = 128, 23 at d = 64)
  measured -1.2% at d = 128, less than the select alone, and +0.5% at d = 64 (run 8): not kept.

The fourteenth, ``dv_before_fence`` (default on; it acts wherever ``late_dv`` does): the dV wgmma is
issued before the proxy fence that publishes the dS^T stores, not after it.

* The fence (SASS ``MEMBAR.ALL.CTA; FENCE.VIEW.ASYNC.S``) waits until this thread's shared stores
  have landed. Only the dQ wgmma after B2 reads sdSt. dV reads P^T from registers and dO from a TMA
  stage, so it need not wait behind 32 (d = 64) or 20 (d = 128) scalar stores.
* The official kernel's d = 64 cubin has this order (its dV HGMMAs sit between the dS stores and the
  fence).
* Traced on the H100 at 4k, all CTAs' cycles (``trace_bwd_h100_run10_*``): d = 64 non-causal -2.9%
  (0.541 -> 0.525 G, the official kernel 0.525 G), d = 64 causal -3.1% (0.290 -> 0.281 G; official
  0.277 G), d = 128 non-causal -0.9% (0.866 -> 0.859 G).
* Same bits: ``same_outputs_bwd.py`` gave dk / dv equal in 8 of 8 cases against the build without it
  (and without ``column_limit``).

The fifteenth, ``column_limit`` (default below the 128-query tile, i.e. d = 96 and 128): the masked
body computes one key limit per query column (``schedule.column_key_limit``; zero for a query past
the sequence) and then tests each score once.

* Before, ptxas emitted a select per condition: 3 FSEL per score, plus a VIADD and 1.5 ISETP. At
  d = 128 causal the masked bodies went from 671 to 611 instructions, with 40 FSEL (one per score).
* Traced at 4k causal (``trace_bwd_h100_run11_*``): with ``dv_before_fence``, d = 128 0.4636 ->
  0.4618 G (official 0.4691 G) and d = 96 -1.9% for the two options together (0.418 -> 0.410 G).
* The 128 x 128 tile (d = 64) spills 32 bytes with it, and its unmasked loop loses the exponentials
  it had ahead of the dP^T wait (5 -> 0 causal), so it keeps the old test.

The sixteenth, ``mask_offsets`` (default for causal d = 64 and 96 outside deterministic mode and
varlen): the masked body's test written against the accumulator layout. Every thread's scores sit at
the same offsets (dr, dc) from its first one (row0, col0), and those offsets are known when the kernel
is traced. So the causal test ``row0 + dr > col0 + dc + diag`` becomes ``rel_r > dc`` with
``rel_r = row0 - col0 - diag + dr``: one register per accumulator row, one compare against an
immediate per score. A key row past the keys sets its ``rel_r`` beyond every ``dc``; a query past the
sequence sets its column's lse2 to +inf, so its exponentials are 0.

* Compiled here: the d = 64 causal masked bodies shrink from 939 to 788 instructions (the official
  kernel's one body: 719) without spilling, where ``column_limit`` spilled; d = 128 causal from 611
  (``column_limit``) to 574. The unmasked loops keep their length.
* Not clean everywhere at d = 64: deterministic non-causal spills 20 bytes, causal varlen 24, and
  deterministic causal serializes its wgmmas (C7512), so those keep the old test. Every d = 96 / 128
  build compiles clean.
* Same bits: ``test_option_changes_no_bit`` (then ``test_mask_offsets_changes_no_bit``; deterministic
  mode, 7 shapes with GQA and both masks) passed on the H100.
* Traced at d = 64 causal 4k (``trace_bwd_h100_run12_*``): the per-CTA intercept fell 5474 -> 5052
  cycles (the masked diagonal tile), the per-tile slope rose 3801 -> 3848, all CTAs 0.280 -> 0.282 G.
* Paired rounds decide (``ab_bwd_h100_run56_*`` .. ``run58_*``; the ratio of the two builds' times
  within each round, median): d = 64 causal +0.5 / +0.8% (4k / 16k, 7 rounds) and +1.1 / +1.1 / +0.9%
  (4k / 8k / 16k, 11 rounds), faster in 30 of 47 rounds; d = 96 causal +0.4 / +1.3%; d = 128 causal
  -0.7 / -3.5% (faster in 4 of 14), so the 80-query tile keeps ``column_limit``.

The seventeenth, ``kv_with_first`` (default for causal d = 64 outside deterministic mode): K is loaded on
the first Q tile's barrier and V on its dO barrier, each adding its bytes to that phase with an
expect-tx that does not arrive, instead of both on a K/V barrier of their own that the consumers wait
for before the walk. The first S^T then waits for K and Q only (V's 16 KB no longer ahead of Q's in the
TMA queue), and dP^T for V and dO: the official kernel's grouping (its ``load``, read in
flash_bwd_sm90.py). An empty walk (a K/V tile past seqused_k) loads neither.

* Found with per-tile clock stamps (``trace_bwd.py --tile-stamps``, ``trace_bwd_h100_run13_*``): at
  d = 64 causal 4k our CTAs took 830 cycles longer than the official kernel's to finish their first
  tile (6155 against 5324 from the consumers' start; later tiles 4093 / 3972 with the stamps in), and
  400 cycles longer from entry to the consumers' start (1034 / 644: our launch-order map divides four
  times before the barriers are set up).
* Traced without tile stamps (``..._run14_*``): the CTA intercept 5087 -> 4895 cycles, all CTAs
  0.282 -> 0.281 G. ``same_outputs_bwd.py``: dq, dk, dv bitwise equal in 8 of 8 cases (deterministic).
* Paired rounds (``ab_bwd_h100_run59_*``, 7 rounds, the two builds' per-round ratio): d = 64 causal
  +0.5 / +0.6% (4k / 16k, faster in 11 of 14 rounds); d = 128 causal +0.6% / -2.3% (7 of 7, 3 of 7),
  so the 80-query tile keeps its K/V barrier.
* Setting the barriers up before the launch-order map instead of after it (tried as an option, not
  kept: ``..._run15_*``) took the prologue from 1046 to 932 cycles, 0.17% of a 4k CTA (all CTAs'
  cycles, start to end, leave the prologue out: 0.281 G either way).
"""
from __future__ import annotations

from stage4_bwd_kernel import common  # must precede cutlass (sets CUTE_DSL_ARCH)
from stage4_bwd_kernel import schedule

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import Float32, Int32, const_expr, pipeline  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402
from cutlass.memory.smem import SmemAllocator  # noqa: E402

from stage3_fwd_kernel import common as fwd_common  # noqa: E402
from stage3_fwd_kernel import trace  # noqa: E402
from stage3_fwd_kernel.hopper_step1_wgmma import acc_rowcol  # noqa: E402
from stage4_bwd_kernel.hopper_step1 import gemm_issue  # noqa: E402
from stage4_bwd_kernel.hopper_step2_warpspec import FlashAttentionBackwardSm90Step2  # noqa: E402

STEP = "hopper_bwd_step3_rs"
NUM_WG_MMA = 2
NUM_THREADS = 128 * (1 + NUM_WG_MMA)
NUM_CONSUMER_THREADS = 128 * NUM_WG_MMA
CONSUMER_BARRIER = 1
DQ_FULL_BARRIER = 2    # + buffer index; "dQ empty" follows the full ones (self.dq_empty_barrier)
DQ_SYNC_THREADS = NUM_CONSUMER_THREADS + 32  # consumers + the writer warp
# decoupled warpgroups: per-warpgroup row statistics and "sdSt free" barriers, then "dQ full" per buffer
# and "dQ empty" per buffer and warpgroup (one consumer warpgroup + the writer warp)
STATS_BARRIER, SDST_FREE_BARRIER, DQ_FULL_BARRIER_DECOUPLED = 2, 2 + NUM_WG_MMA, 2 + 2 * NUM_WG_MMA
DQ_EMPTY_SYNC_THREADS_WG = 128 + 32
NUM_NAMED_BARRIERS = 16
DQ_WRITER_WARP = 1     # first dQ writer warp of the producer warpgroup (warp 0 issues the TMA loads)
DQ_BUFFERS = 2        # one when two do not fit in SMEM (the 80 x 128 tile)
RS_HEAD_DIMS = ((64, 64), (96, 96), (128, 128))
STATS_SHUFFLE_ROWS = 128  # 32 lanes x 4 statistics (stats_shuffle)
REGS_PRODUCER, REGS_CONSUMER = 24, 240  # sums to 3 x 168: setmaxnreg only redistributes the CTA's launch registers


def check_rs_head_dims(head_dim: int, head_dim_v: int):
    """ValueError for the head dims whose RS accumulators do not fit the consumers' registers (docstring)."""
    if (head_dim, head_dim_v) not in RS_HEAD_DIMS:
        need = (64 * head_dim + 64 * head_dim_v) // 128 + 2 * 32 + 16
        raise ValueError(f"head_dim: {STEP} supports (q/k, v) head dims {RS_HEAD_DIMS}, got {(head_dim, head_dim_v)}: "
                         f"its dK + dV + S^T + dP^T + P^T accumulators would take {need} registers per consumer "
                         f"thread of the {REGS_CONSUMER} available (use hopper_step1)")


def default_tiles(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """(tile_m, tile_n): 64 keys per consumer warpgroup (wgmma M) and 64 queries at d = 96; 128 queries
    at d = 64, where dV issued after dS and dQ split by query rows keep the 128 x 128 tile in 240
    registers; 80 queries at d = 128, with dQ^T = K^T dS^T (80 is no wgmma M) and one dQ buffer."""
    check_rs_head_dims(head_dim, head_dim_v)
    return {(64, 64): (128, 128), (128, 128): (80, 128)}.get((head_dim, head_dim_v), (64, 128))


# Row statistics by shuffle (stats_shuffle, the official kernel's technique for its d = 64 tile, read in
# its flash_bwd_sm90.py; no code used). Column c of a thread's S^T / dP^T accumulator (row-col view of a
# 64 x tm wgmma C fragment) is query 8 (c // 2) + 2 (lane % 4) + c % 2: tm / 4 different statistics per
# thread and tile, read from SMEM as tm / 8 LDS.64 each for lse2 and D. Instead lane l keeps the 4 queries
# 16 (l // 4) + 8 h + 2 (l % 4) + e (h, e in {0, 1}) in registers (one LDS.128 per tile) and each use is
# a shfl.idx from the lane that holds it, with the same register index in every lane (as shfl needs).
def stats_slot(q):
    """SMEM position of query row q's statistic, so that lane l's 4 values are slots 4 l .. 4 l + 3."""
    return q // 16 * 16 + (q % 8) // 2 * 4 + (q % 16) // 8 * 2 + q % 2


def stats_shuffle_source(c: int, lane):
    """(source lane, register index) holding the statistic of accumulator column c of this lane."""
    j = c // 2
    return (j // 2) * 4 + lane % 4, (j % 2) * 2 + c % 2


def dq_frag_tiled_copy() -> cute.TiledCopy:
    """dq_frag: a warpgroup's 128 threads x 4 consecutive fp32 (16 bytes) per copy over a flat share."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, cute.make_layout(128), cute.make_layout(4))


@dsl_user_op
def bulk_reduce_add_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: cutlass.Constexpr[int], *,
                        loc=None, ip=None) -> None:
    """gmem[0:n] += smem[0:n] (fp32, n = num_bytes / 4) by the TMA unit (SASS UBLKRED):
    ``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``; 16-byte aligned addresses, num_bytes
    a multiple of 16. Completion: ``cp.async.bulk.commit_group``, then ``wait_group[.read]``."""
    g = gmem_ptr.toint(loc=loc, ip=ip).ir_value()
    s = smem_ptr.toint(loc=loc, ip=ip).ir_value()
    llvm.inline_asm(None, [g, s], f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], {num_bytes};",
                    "l,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def thread_idx_fresh(*, loc=None, ip=None) -> Int32:
    """%tid.x read again where it is used (volatile asm: not merged with earlier reads)."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %tid.x;", "=r",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


class FlashAttentionBackwardSm90Step3(FlashAttentionBackwardSm90Step2):
    """Step 2's producer warp + 2 consumer warpgroups, with keys split across the consumers, RS dV/dK,
    and a dQ writer warp (TMA bulk reduce-add from a double-buffered SMEM tile)."""

    def __init__(self, dtype, head_dim: int, head_dim_v: int, causal: bool, deterministic: bool = False, *,
                 varlen: bool = False, has_seqused_k: bool = False, tile_m: int | None = None,
                 tile_n: int | None = None, num_stages: int = 2, dq_order=None, late_dv: bool | None = None,
                 dq_split_m: bool | None = None, dq_swap_ab: bool | None = None,
                 dq_buffers: int | None = None, dq_swizzle32: bool | None = None,
                 stats_shuffle: bool | None = None, decoupled: bool | None = None, ds_buffers: int | None = None,
                 dq_full_per_wg: bool | None = None, stats_tma: bool | None = None,
                 sem_early: bool | None = None, dq_writers: int | None = None, dq_frag: bool | None = None,
                 q_shift: bool | None = None, key_select: bool | None = None, dv_before_fence: bool | None = None,
                 column_limit: bool | None = None, mask_offsets: bool | None = None,
                 kv_with_first: bool | None = None):
        dm, dn = default_tiles(head_dim, head_dim_v)
        super().__init__(dtype, head_dim, head_dim_v, causal, deterministic, varlen=varlen,
                         has_seqused_k=has_seqused_k, tile_m=tile_m or dm, tile_n=tile_n or dn,
                         num_stages=num_stages, dq_order=dq_order)
        self.dq_swap_ab = self.tile_m % 64 != 0 if dq_swap_ab is None else dq_swap_ab
        if self.tile_n != 64 * NUM_WG_MMA or (self.tile_m % 64 and not self.dq_swap_ab):
            raise ValueError(f"tiles: {STEP} needs tile_n = {64 * NUM_WG_MMA} (64 keys per consumer warpgroup) and "
                             f"tile_m a multiple of 64 (the M of dQ = dS K) unless dQ^T = K^T dS^T is formed "
                             f"instead (dq_swap_ab), got ({self.tile_m}, {self.tile_n})")
        if self.dq_swap_ab and (self.head_dim != 64 * NUM_WG_MMA or self.tile_m % 16 or self.tile_m > 128):
            raise ValueError(f"tiles: dq_swap_ab puts d on the M of the dQ wgmma (64 per warpgroup), so it needs "
                             f"head_dim = {64 * NUM_WG_MMA} and tile_m a multiple of 16 up to 128, got head_dim "
                             f"{self.head_dim}, tile_m {self.tile_m}")
        self.regs_producer, self.regs_consumer = REGS_PRODUCER, REGS_CONSUMER
        self.decoupled = True if decoupled is None else decoupled
        # dS^T double-buffered (tile t in buffer t % 2): B2 of tile t - 1 then already orders the other
        # warpgroup's dQ read of tile t - 2 before this warpgroup's stores, so decoupled warpgroups need
        # no "sdSt free" barriers (the docstring's seventh option)
        self.ds_buffers = self._default_ds_buffers() if ds_buffers is None else ds_buffers
        if self.ds_buffers not in (1, 2):
            raise ValueError(f"ds_buffers: expected 1 or 2, got {ds_buffers!r}")
        self.dq_buffers = self._default_dq_buffers() if dq_buffers is None else dq_buffers
        # "dQ full" per buffer: both consumer warpgroups arrive (never wait) and the writer syncs; "dQ empty"
        # per buffer, and per warpgroup when decoupled (only the warpgroup that refills a share waits for it)
        self.dq_full_barrier = DQ_FULL_BARRIER_DECOUPLED if self.decoupled else DQ_FULL_BARRIER
        # "dQ full" per buffer and warpgroup too (160 threads): the writer reduces a warpgroup's share as
        # soon as that warpgroup has stored it, not when both have
        self.dq_full_per_wg = False if dq_full_per_wg is None else bool(dq_full_per_wg)
        if self.dq_full_per_wg and not self.decoupled:
            raise ValueError("dq_full_per_wg: needs decoupled warpgroups (coupled ones store their shares together)")
        self.dq_empty_barrier = self.dq_full_barrier + self.dq_buffers * (NUM_WG_MMA if self.dq_full_per_wg else 1)
        self.dq_empty_threads = DQ_EMPTY_SYNC_THREADS_WG if self.decoupled else DQ_SYNC_THREADS
        self.num_barriers = self.dq_empty_barrier + self.dq_buffers * (NUM_WG_MMA if self.decoupled else 1)
        if self.num_barriers > NUM_NAMED_BARRIERS:
            raise ValueError(f"dq_buffers: {self.dq_buffers} dQ buffers{' with decoupled warpgroups' * self.decoupled} "
                             f"need {self.num_barriers} named barriers; a CTA has {NUM_NAMED_BARRIERS}")
        # the 64-query tile (d = 96) issues dV early except causal, where late measured +1..+7%
        self.late_dv = (self.tile_m != 64 or self.causal) if late_dv is None else late_dv
        self.dq_split_m = self.tile_m == 64 * NUM_WG_MMA if dq_split_m is None else dq_split_m
        self.dq_swizzle32 = self.dq_split_m if dq_swizzle32 is None else dq_swizzle32
        # dQaccum in fragment order (the eleventh option): each warpgroup's share of a dQ tile is one
        # contiguous chunk, in the order its threads hold the accumulator, in sdQ and in global memory
        # (B, H, padded rows, d); the writer adds a share with one 1-D bulk reduce, and
        # postprocess_frag puts the elements back in place
        # on by default where it measured faster: non-causal d = 64 and 128 (+0..+6%, ab_bwd_h100_run35..37),
        # causal d = 64 without stats_shuffle (+4..+5%, run38), causal d = 128 (+3..+5%, run39) and d = 96
        # (+11% / +6% at 4k, run40), causal deterministic d = 64 (+6% at 4k, run41) and d = 96 (+2..+3% at
        # 4k / 8k, run46); causal deterministic d = 128 (the 80-query tile) measured -1..-2.5% (runs 41, 46),
        # so it alone keeps the TMA tensor reduce
        if dq_frag is None:
            dq_frag = not (causal and deterministic and self.tile_m == 80)
        self.dq_frag = bool(dq_frag)
        # off where ptxas would serialize the wgmmas (C7512): d = 64 causal default mode with dq_frag
        self.stats_shuffle = ((self.tile_m == 128 and not (self.dq_frag and causal and not deterministic))
                              if stats_shuffle is None else stats_shuffle)
        if self.stats_shuffle and (self.tile_m > STATS_SHUFFLE_ROWS or self.tile_m % 16):
            raise ValueError(f"tiles: stats_shuffle spreads the row statistics of a Q tile over the "
                             f"{STATS_SHUFFLE_ROWS // 4} lanes of a warp, 4 each, so it needs tile_m a multiple of 16 "
                             f"up to {STATS_SHUFFLE_ROWS}, got {self.tile_m}")
        # the producer loads each Q tile's lse2 / D with TMA on its Q / dO barriers (the eighth option)
        self.stats_tma = True if stats_tma is None else bool(stats_tma)
        # deterministic: the writer acquires a tile's semaphore before it waits for the tile, and frees
        # the buffer once the TMA has read it, before waiting for the adds to land (the ninth option)
        self.sem_early = True if sem_early is None else bool(sem_early)
        # writer warps (1 + w of the producer warpgroup) taking turns by tile: warp w owns the dQ buffers
        # b with b % dq_writers == w, so each buffer's barriers still see one writer warp (the tenth option)
        self.dq_writers = (self.dq_buffers if deterministic else 1) if dq_writers is None else int(dq_writers)
        if self.dq_writers not in (1, 2, 3) or self.dq_buffers % self.dq_writers:
            raise ValueError(f"dq_writers: expected 1, 2 or 3 dividing dq_buffers ({self.dq_buffers}), got {dq_writers!r}")
        # Q tiles counted from the end of the sequence (the twelfth option, module docstring)
        if q_shift is None:
            q_shift = (causal and not varlen and not deterministic and self.dq_frag and self.stats_tma
                       and self.tile_n % self.tile_m != 0)
        if q_shift and (varlen or not self.dq_frag or not self.stats_tma):
            raise ValueError("q_shift: needs a dense (not varlen) kernel with dq_frag and stats_tma (the padding rows "
                             "are loaded past the tensor's start, as zeros)")
        self.q_shift = bool(q_shift)
        # the key-bound select in the unmasked body too (the thirteenth option, module docstring): on for
        # the 80-query tile outside deterministic mode, where it was traced (-3.9% / -3.4% cycles)
        self.key_select = (self.tile_m == 80 and not deterministic) if key_select is None else bool(key_select)
        # late_dv: issue dV before the dS^T stores' proxy fence (the fourteenth option, module docstring)
        self.dv_before_fence = True if dv_before_fence is None else bool(dv_before_fence)
        # masked bodies: one key limit per query column (the fifteenth option, module docstring); the
        # 128-query tile spilled with it
        self.column_limit = self.tile_m != 128 if column_limit is None else bool(column_limit)
        # masked bodies: the test against the accumulator's static offsets (the sixteenth option, module
        # docstring): on where it was timed faster, causal d = 64 and 96 outside deterministic mode and
        # varlen (d = 64 spills or serializes there); the 80-query tile (d = 128) measured slower
        if mask_offsets is None:
            mask_offsets = causal and not deterministic and not varlen and head_dim <= 96
        self.mask_offsets = bool(mask_offsets)
        # K on the first Q tile's barrier, V on its dO barrier (the seventeenth option, module docstring):
        # on where it was timed, the 128-query tile (d = 64) causal outside deterministic mode
        if kv_with_first is None:
            kv_with_first = causal and not deterministic and self.tile_m == 128
        self.kv_with_first = bool(kv_with_first)

    def _smem_need(self, ds_buffers: int, dq_buffers: int) -> int:
        """Bytes of K, V, the Q/dO stages, the dS^T buffers and the fp32 dQ buffers, + 2 KB for the
        barriers and the row statistics (two copies when decoupled, or a ring of stages with stats_tma)."""
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        operands = (tn * (d + dv) + self.num_stages * tm * (d + dv) + ds_buffers * tn * tm) * 2  # fp16 / bf16
        return operands + dq_buffers * tm * d * 4 + 2048

    def _default_ds_buffers(self) -> int:
        """Two dS^T buffers below the 128-query tile when they fit beside one dQ buffer (d = 96 and 128:
        +2..+7% with decoupled warpgroups, ab_bwd_h100_run20_ds_buffers2.json, ..._run21_d96_ds_buffers2.json); the
        128 x 128 tile (d = 64) measured a tie and keeps one (two fill the 227 KB exactly)."""
        if self.tile_m >= 128:
            return 1
        return 2 if self._smem_need(2, 1) <= fwd_common.SMEM_BUDGET else 1

    def _default_dq_buffers(self) -> int:
        """Two dQ buffers when they fit the 227 KB of SMEM with everything else, else one (80 x 128
        at d = 128: 264 KB with two)."""
        return DQ_BUFFERS if self._smem_need(self.ds_buffers, DQ_BUFFERS) <= fwd_common.SMEM_BUDGET else 1

    def _dq_share(self) -> tuple[int, int]:
        """(rows, columns) of one consumer warpgroup's share of a dQ tile: its 64 query rows (dq_split_m)
        or its d / 2 columns (the dQ wgmma splits N, or with dq_swap_ab the M of dQ^T)."""
        if self.dq_split_m:
            return self.tile_m // NUM_WG_MMA, self.head_dim
        return self.tile_m, self.head_dim // NUM_WG_MMA

    def _sdq_layout(self, shares: bool = True):
        """(rows, cols, warpgroups x buffers) fp32: each consumer's share of a dQ tile (_dq_share) is a
        tile of its own, swizzled rows that one TMA tensor copy reads (share s = buffer * 2 + warpgroup),
        so the writer can reduce each warpgroup's share as soon as that warpgroup has stored it. The
        span is sized for d / 2 columns (128 bytes at d = 128, 64 at d = 96), or 32 bytes with
        dq_swizzle32 (the d = 64 tile, whose warpgroups store all d columns of their rows: in a
        128-byte span rows r and r ^ 1 of one 8-byte store share banks). shares=False: one share --
        built, not sliced: this CuTe-DSL aborts (SIGABRT, no message) slicing the last mode of a
        swizzled layout for some row counts (seen at 48, 72, 80, 112)."""
        atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, Float32,
                                                    8 if self.dq_swizzle32 else self.head_dim // NUM_WG_MMA)
        atom = warpgroup.make_smem_layout_atom(atom_kind, Float32)
        rows, cols = self._dq_share()
        if not shares:
            return cute.tile_to_shape(atom, (rows, cols), (0, 1))
        return cute.tile_to_shape(atom, (rows, cols, NUM_WG_MMA * self.dq_buffers), (0, 1, 2))

    def dq_frag_share_elems(self) -> int:
        """fp32 elements of one warpgroup's share of a dQ tile (dq_frag: one contiguous chunk)."""
        return self.tile_m * self.head_dim // NUM_WG_MMA

    def _sdq_frag_layout(self) -> cute.ComposedLayout:
        """dq_frag: (share elements, warpgroups x buffers), unswizzled (an identity swizzle keeps the
        ComposedLayout interface of _sdq_layout); a warp's 16-byte stores cover 512 contiguous bytes."""
        return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, cute.make_layout(
            (self.dq_frag_share_elems(), NUM_WG_MMA * self.dq_buffers)))

    def top_padding(self, seqlen_q):
        """q_shift: rows of zeros before query 0, so the Q tiles end with the sequence: the distance to
        the next multiple of tile_m, rounded down to a multiple of 4 (the row statistics' TMA boxes
        start 16-byte aligned). Python ints or traced Int32."""
        return fwd_common.top_padding(seqlen_q, self.tile_m, multiple=4)

    def dq_frag_tile_row(self, offset_q, batch, m_block):
        """dq_frag: first row of dQ tile m_block of sequence `batch` in the (B, H, rows, d) dQaccum.
        Tiles are tile_m rows apart; a varlen sequence's first tile is
        (offset_q + batch * tile_m) // tile_m, so each sequence owns whole tiles and none overlaps the
        next (dense: tile m_block)."""
        first = (offset_q + batch * self.tile_m) // self.tile_m if const_expr(self.varlen) else 0
        return (first + m_block) * self.tile_m

    def dq_frag_accum_rows(self, rows_q: int, batch: int) -> int:
        """Host: rows of the (B, H, rows, d) dQaccum for seqlen_q (dense) or total_q (varlen) rows."""
        extra = (batch + 1) * self.tile_m if self.varlen else 0
        return common.cdiv(rows_q + extra, self.tile_m) * self.tile_m

    def make_tiled_mma_dQ(self) -> cute.TiledMma:
        """dQ (tm x d) = dS K: A = dS (MN-major view of dS^T), B = K^T (MN-major); the warpgroups split
        the query rows (dq_split_m) or the d columns; dq_swap_ab: dQ^T (d x tm) = K^T dS^T, the
        warpgroups split d (M) and tm is the N, so tm need not be a multiple of 64. (postprocess_frag
        builds it too: its partition says where each register of the fragment order belongs.)"""
        mn = cute.nvgpu.OperandMajorMode.MN
        wg_m, wg_n = (NUM_WG_MMA, 1, 1), (1, NUM_WG_MMA, 1)
        dq_split, dq_tile = (wg_m, (64, self.head_dim)) if self.dq_split_m else (wg_n, (64, self.head_dim // NUM_WG_MMA))
        if const_expr(self.dq_swap_ab):
            dq_split, dq_tile = wg_m, (64, self.tile_m)
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, mn, mn, Float32, dq_split, dq_tile)

    def _sdq_tile_view(self) -> cute.Layout:
        """(tm, d, buffers) -> index into the shares of _sdq_layout: the dQ tiles as the consumers' MMA
        partitions see them (warpgroup w's rows or columns land in share buffer * 2 + w)."""
        rows, cols = self._dq_share()
        share = rows * cols
        if self.dq_split_m:
            return cute.make_layout(((rows, NUM_WG_MMA), cols, self.dq_buffers),
                                    stride=((1, share), rows, NUM_WG_MMA * share))
        return cute.make_layout((rows, (cols, NUM_WG_MMA), self.dq_buffers),
                                stride=(1, (rows, share), NUM_WG_MMA * share))

    # -------------------------------------------------------------- host side (traced once)
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor,
                 mSemaphore: cute.Tensor, num_n_blocks: Int32, softmax_scale_log2: Float32,
                 softmax_scale: Float32, stream):
        # same arguments as step 1 (see there for shapes)
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mdO.element_type
                           == mdK.element_type == mdV.element_type == self.dtype)):
            raise TypeError("q, k, v, dout, dk, dv must share the kernel's dtype")
        tm, tn, d, dv, stages = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        mQ, mK, mdK = (common.assume_aligned(t, d) for t in (mQ, mK, mdK))
        mV, mdO, mdV = (common.assume_aligned(t, dv) for t in (mV, mdO, mdV))
        mdQacc = common.assume_aligned(mdQacc, d)
        mLSE2, mD = common.assume_aligned(mLSE2), common.assume_aligned(mD)  # (B, H, Sq): rows of 16-byte multiples

        # Swizzles: Q / dO are the MN-major B of dK / dV with N = d / dv whole (one warpgroup), K the
        # MN-major B of dQ with N split (d/2); each also serves as a K-major operand of S^T / dP^T.
        sQ_layout = self._smem_layout(tm, d, d, stages)
        sdO_layout = self._smem_layout(tm, dv, dv, stages)
        sK_layout = self._smem_layout(tn, d, d // NUM_WG_MMA)
        sV_layout = self._smem_layout(tn, dv, dv // NUM_WG_MMA)
        sdSt_layout = self._smem_layout(tn, tm, tm, self.ds_buffers)       # dS^T: (keys, queries, buffers)
        sdQ_layout = self._sdq_frag_layout() if const_expr(self.dq_frag) else self._sdq_layout()

        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wg_m = (NUM_WG_MMA, 1, 1)
        # S^T, dP^T (tn x tm): the warpgroups split the keys (M)
        tiled_mma_SdP = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32,
                                                          wg_m, (64, tm))
        # dV (tn x dv) += P^T dO, dK (tn x d) += dS^T Q: same key split, A from registers
        tiled_mma_dV = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32,
                                                         wg_m, (64, dv), a_source=warpgroup.OperandSource.RMEM)
        tiled_mma_dK = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32,
                                                         wg_m, (64, d), a_source=warpgroup.OperandSource.RMEM)
        tiled_mma_dQ = self.make_tiled_mma_dQ()

        def seq_dim_first(t):  # (B, S, H, D) -> (S, D, H, B), same memory
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mQ), cute.slice_(sQ_layout, (None, None, 0)), (tm, d))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mdO), cute.slice_(sdO_layout, (None, None, 0)), (tm, dv))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_load, seq_dim_first(mK), sK_layout, (tn, d))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_load, seq_dim_first(mV), sV_layout, (tn, dv))
        # dQ: one TMA reduce-add per warpgroup share of a tile (_dq_share) from sdQ into dQaccum (dq_frag
        # reduces with bulk copies instead and has no TMA descriptor to build)
        tma_atom_dQ, tma_dQ = None, None
        if const_expr(not self.dq_frag):
            tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), seq_dim_first(mdQacc), self._sdq_layout(shares=False),
                self._dq_share())
        self.tma_bytes_Q = cute.size_in_bytes(self.dtype, cute.slice_(sQ_layout, (None, None, 0)))
        self.tma_bytes_dO = cute.size_in_bytes(self.dtype, cute.slice_(sdO_layout, (None, None, 0)))
        self.tma_bytes_K = cute.size_in_bytes(self.dtype, sK_layout)
        self.tma_bytes_V = cute.size_in_bytes(self.dtype, sV_layout)
        self.tma_bytes_KV = self.tma_bytes_K + self.tma_bytes_V
        # lse2 / D of a Q tile: tm fp32 in a (tm, stages) ring whose stages start on 128-byte boundaries
        # (a TMA destination); rows past the tensor arrive as 0, masked like the rows of Q / dO past it
        sStat_layout = cute.make_layout((tm, stages), stride=(1, (tm + 31) // 32 * 32))
        tma_atom_LSE2, tma_LSE2 = cpasync.make_tiled_tma_atom(
            tma_load, cute.make_tensor(mLSE2.iterator, cute.select(mLSE2.layout, mode=[2, 1, 0])),
            cute.slice_(sStat_layout, (None, 0)), (tm,))                  # (Sq, H, B) view
        tma_atom_D, tma_D = cpasync.make_tiled_tma_atom(
            tma_load, cute.make_tensor(mD.iterator, cute.select(mD.layout, mode=[2, 1, 0])),
            cute.slice_(sStat_layout, (None, 0)), (tm,))
        if const_expr(self.stats_tma):
            self.tma_bytes_Q += tm * 4
            self.tma_bytes_dO += tm * 4

        # stats_tma: a ring of stages; else one copy of the row statistics (per consumer warpgroup, decoupled)
        stats_len = (STATS_SHUFFLE_ROWS if self.stats_shuffle else tm) * (NUM_WG_MMA if self.decoupled else 1)
        if const_expr(self.stats_tma):
            stats_len = cute.cosize(sStat_layout)

        @cute.struct
        class SharedStorage:
            mbar_KV: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_dO: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, stats_len], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, stats_len], 128]
            sOffsets: cute.struct.MemRange[Int32, 3]  # (offset_k, key rows left, first row of its lse2 / D), see consume
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sdSt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdSt_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

        batch = mCuSeqlensQ.shape[0] - 1 if const_expr(self.varlen) else mQ.shape[0]
        self.kernel(tma_Q, tma_dO, tma_K, tma_V, mQ.shape[1], mK.shape[1], mLSE2, mD, mdQacc, mdK, mdV,
                    mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSemaphore, num_n_blocks, mQ.shape[2] // mK.shape[2],
                    softmax_scale_log2, softmax_scale,
                    tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_dQ, tma_atom_dQ,
                    tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ,
                    sQ_layout, sdO_layout, sK_layout, sV_layout, sdSt_layout, sdQ_layout,
                    self._gmem_store(d), self._gmem_store(dv), tma_LSE2, tma_D, tma_atom_LSE2, tma_atom_D,
                    sStat_layout,
                    # min_blocks_per_mp=1 caps registers at entry (65536/384), which setmaxnreg needs
                    ).launch(grid=(num_n_blocks, mK.shape[2], batch), block=[self.num_threads, 1, 1],
                             stream=stream, min_blocks_per_mp=1)

    # -------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_Q: cute.Tensor, tma_dO: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor,
               total_q: Int32, total_k: Int32, mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
               mSeqUsedK: cute.Tensor, mSemaphore: cute.Tensor, num_n_blocks: Int32, qhead_per_kvhead: Int32,
               softmax_scale_log2: Float32, softmax_scale: Float32,
               tma_atom_Q: cute.CopyAtom, tma_atom_dO: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
               tma_atom_V: cute.CopyAtom, tma_dQ: cute.Tensor, tma_atom_dQ: cute.CopyAtom,
               tiled_mma_SdP: cute.TiledMma, tiled_mma_dV: cute.TiledMma, tiled_mma_dK: cute.TiledMma,
               tiled_mma_dQ: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sdSt_layout: cute.ComposedLayout, sdQ_layout: cute.ComposedLayout,
               gmem_store_dK: cute.TiledCopy, gmem_store_dV: cute.TiledCopy, tma_LSE2: cute.Tensor,
               tma_D: cute.Tensor, tma_atom_LSE2: cute.CopyAtom, tma_atom_D: cute.CopyAtom,
               sStat_layout: cute.Layout):
        tn = self.tile_n
        trace.cta_stamp("entry")  # no code unless benchmarks/trace_bwd.py turned tracing on
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group_idx = cute.arch.make_warp_uniform(tidx // 128)
        n_block, head_kv, batch, bidx, offset_q, offset_k, seqlen_q, seqlen_k_rows, seqlen_k = self.tile_bounds(
            num_n_blocks, total_q, total_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        if const_expr(self.q_shift):
            # virtual rows: padding rows first; bottom-right causal alignment is unchanged (both q and
            # seqlen_q move by pad), and the padding rows' Q, dO, lse2 and D arrive as zeros (TMA past
            # the tensor's start), so every product they enter is zero
            pad = self.top_padding(seqlen_q)
            offset_q, seqlen_q = offset_q - pad, seqlen_q + pad

        if n_block * tn < seqlen_k_rows:
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_atom_Q)
                cpasync.prefetch_descriptor(tma_atom_dO)
                cpasync.prefetch_descriptor(tma_atom_K)
                cpasync.prefetch_descriptor(tma_atom_V)
                if const_expr(self.stats_tma):
                    cpasync.prefetch_descriptor(tma_atom_LSE2)
                    cpasync.prefetch_descriptor(tma_atom_D)
            if const_expr(not self.dq_frag):
                if warp_idx == DQ_WRITER_WARP:
                    cpasync.prefetch_descriptor(tma_atom_dQ)
            smem = SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            pipe_KV, pipe_Q, pipe_dO = self.make_pipelines(storage)   # step 2's prologue
            walk = self.make_walk(n_block, head_kv, batch, bidx, offset_q, offset_k, seqlen_q, seqlen_k_rows,
                                  seqlen_k, qhead_per_kvhead)

            if warp_group_idx == 0:
                # ---------------------------------------------------------------- producer warpgroup
                cute.arch.setmaxregister_decrease(self.regs_producer)
                if warp_idx == 0:    # TMA loads: step 2's producer (+ the row statistics with stats_tma)
                    stats = None
                    if const_expr(self.stats_tma):
                        stats = ((tma_atom_LSE2, tma_LSE2, storage.sLSE2.get_tensor(sStat_layout)),
                                 (tma_atom_D, tma_D, storage.sD.get_tensor(sStat_layout)))
                    self.produce(walk, storage, tma_Q, tma_dO, tma_K, tma_V, tma_atom_Q, tma_atom_dO,
                                 tma_atom_K, tma_atom_V, sQ_layout, sdO_layout, sK_layout, sV_layout,
                                 pipe_KV, pipe_Q, pipe_dO, stats=stats)
                if warp_idx >= DQ_WRITER_WARP and warp_idx < DQ_WRITER_WARP + self.dq_writers:
                    self.write_dq(walk, storage, mdQacc, tma_dQ, tma_atom_dQ, mSemaphore, sdQ_layout,
                                  warp_idx - DQ_WRITER_WARP)
            else:
                # ---------------------------------------------------------------- consumers
                cute.arch.setmaxregister_increase(self.regs_consumer)
                self.consume(walk, tidx - 128, storage, mLSE2, mD, mdK, mdV, softmax_scale_log2, softmax_scale,
                             tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ, sQ_layout, sdO_layout,
                             sK_layout, sV_layout, sdSt_layout, sdQ_layout, gmem_store_dK, gmem_store_dV,
                             pipe_KV, pipe_Q, pipe_dO, sStat_layout)

    # -------------------------------------------------------------- dQ writer warp
    @cute.jit
    def write_dq(self, walk, storage, mdQacc: cute.Tensor, tma_dQ: cute.Tensor, tma_atom_dQ: cute.CopyAtom,
                 mSemaphore: cute.Tensor, sdQ_layout: cute.ComposedLayout, writer: Int32):
        """Each dQ tile's two warpgroup shares -> dQaccum, one bulk reduce (dq_frag) or TMA tensor
        reduce-add each (one lane issues, the warp syncs): decoupled, each share as soon as its warpgroup has stored it. With
        dq_writers > 1, writer warp `writer` takes only the tiles of its own buffers."""
        (seqlen_q, seqlen_k, seqlen_k_rows, offset_q, offset_k, bidx, batch, head_kv, n_block,
         m_block_min, m_block_max, qhead_per_kvhead) = walk
        lane = cute.arch.lane_idx()
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)  # (rows, cols, shares)
        share = self._dq_share()
        n_m = m_block_max - m_block_min
        n_tiles = qhead_per_kvhead * n_m
        share_elems = self.dq_frag_share_elems()
        for head_in_group in cutlass.range(qhead_per_kvhead, unroll=1):
            head = head_kv * qhead_per_kvhead + head_in_group
            tDsD, tDgD = None, None
            if const_expr(not self.dq_frag):
                gdQ = cute.local_tile(cute.domain_offset((offset_q, 0), tma_dQ[None, None, head, bidx]), share,
                                      (None, None))                              # (rows, cols, m, n)
                tDsD, tDgD = cpasync.tma_partition(tma_atom_dQ, 0, cute.make_layout(1),
                                                   cute.group_modes(sdQ, 0, 2), cute.group_modes(gdQ, 0, 2))
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                t = head_in_group * n_m + m_block - m_block_min
                buf = t % self.dq_buffers
                mine = True
                if const_expr(self.dq_writers > 1):
                    mine = t % self.dq_writers == writer   # writer w: the tiles of its buffers
                if mine:
                    # 1. the consumers' dQ tile is in sdQ[buf] (their stores were proxy-fenced); per
                    #    warpgroup: waited for share by share in the loop below
                    if const_expr(self.deterministic and self.sem_early):
                        self.acquire_dq_tile(mSemaphore, seqlen_q, seqlen_k, batch, head, n_block, m_block, lane)
                    if const_expr(not self.dq_full_per_wg):
                        self.dq_full(buf, 0, wait=True)
                    if const_expr(self.deterministic and not self.sem_early):
                        self.acquire_dq_tile(mSemaphore, seqlen_q, seqlen_k, batch, head, n_block, m_block, lane)
                    # a loop, not unrolled: each TMA copy expands to one elected issue per swizzle span,
                    # and two copies' worth of them spilled the writer's 24 registers
                    for w in cutlass.range(NUM_WG_MMA, unroll=1):
                        # 2. one TMA reduce-add per share. Rows past the sequence: dense, they lie outside
                        #    the tensor and the TMA unit skips them; varlen, they are the next sequence's
                        #    first rows, and what lands there is exactly +-0 (those queries' P, hence dS and
                        #    dQ, are 0), which changes no value -- and the sign of a sum of zeros does not
                        #    depend on the order of the adds, so deterministic mode stays bitwise reproducible.
                        #    The whole warp calls the TMA copy (it elects one lane with elect.sync, which
                        #    needs the warp converged); every lane commits and waits on its own (possibly
                        #    empty) bulk group, so the issuing lane, whichever it is, waits for its reduce.
                        if const_expr(self.dq_full_per_wg):
                            self.dq_full(buf, w, wait=True)
                        g_m, g_n = m_block, w
                        if const_expr(self.dq_split_m):
                            g_m, g_n = m_block * NUM_WG_MMA + w, 0
                        if const_expr(self.dq_frag):
                            # the share is share_elems contiguous floats in sdQ and in dQaccum
                            if lane == 0:
                                bulk_reduce_add_f32(
                                    common.elem_pointer(mdQacc, (bidx, head, self.dq_frag_tile_row(offset_q, batch, m_block), 0))
                                    + w * share_elems,
                                    common.elem_pointer(sdQ, (0, buf * NUM_WG_MMA + w)), share_elems * 4)
                        else:
                            cute.copy(tma_atom_dQ, tDsD[None, buf * NUM_WG_MMA + w], tDgD[None, g_m, g_n])
                        cute.arch.cp_async_bulk_commit_group()
                    refill = t + self.dq_buffers < n_tiles  # a tile t + buffers will wait for this buffer
                    if const_expr(self.deterministic and not self.sem_early):
                        self.release_dq_tile(mSemaphore, batch, head, m_block, lane)
                    elif const_expr(self.decoupled and not self.deterministic):
                        # 3a. share 0 may be refilled once it has been read, whatever share 1 is doing
                        cute.arch.cp_async_bulk_wait_group(1, read=True)
                        cute.arch.sync_warp()
                        if refill:
                            self.dq_empty(buf, 0, wait=False)
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # the shares have been read
                    cute.arch.sync_warp()
                    # 3b. the buffer (its last share, decoupled) may be refilled
                    if refill:
                        for w in cutlass.range_constexpr(NUM_WG_MMA if self.decoupled else 1):
                            if const_expr(not self.decoupled or self.deterministic or w > 0):
                                self.dq_empty(buf, w, wait=False)
                    if const_expr(self.deterministic and self.sem_early):
                        self.release_dq_tile(mSemaphore, batch, head, m_block, lane)
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.sync_warp()

    @cute.jit
    def acquire_dq_tile(self, mSemaphore: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, batch: Int32, head: Int32,
                        n_block: Int32, m_block: Int32, lane: Int32):
        """Deterministic mode: lane 0 spins until dQ tile (batch, head, m_block)'s counter reaches this
        CTA's rank (K/V tile n_block's) in the dQ order; the warp, and its async-proxy adds, follow."""
        n_block_last = schedule.n_block_last(m_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.causal,
                                             imin=cutlass.min)
        common.semaphore_wait(common.elem_pointer(mSemaphore, (batch, head, m_block)),
                              self.dq_order.rank(n_block, Int32(0), n_block_last), lane)
        cute.arch.sync_warp()                  # lane 0's acquire precedes everyone
        cute.arch.fence_proxy("async.global")  # ... and the async-proxy adds below

    @cute.jit
    def release_dq_tile(self, mSemaphore: cute.Tensor, batch: Int32, head: Int32, m_block: Int32, lane: Int32):
        """Deterministic mode: once this CTA's adds into dQ tile (batch, head, m_block) have *landed*,
        lane 0 lets the next CTA in the order add (the pointer is formed here again: kept from the
        acquire, it spilled in the writer's 24 registers)."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_proxy("async.global")
        cute.arch.sync_warp()
        common.semaphore_signal(common.elem_pointer(mSemaphore, (batch, head, m_block)), lane)

    @cute.jit
    def dq_full(self, buf: Int32, w, wait: cutlass.Constexpr[bool]):
        """bar.sync (the writer, wait) or bar.arrive (a consumer warpgroup) on "dQ full" of buffer buf --
        with dq_full_per_wg, of warpgroup w's share (160 threads), else of both (288)."""
        if const_expr(self.dq_full_per_wg):
            bar_id, threads = self.dq_full_barrier + buf * NUM_WG_MMA + w, DQ_EMPTY_SYNC_THREADS_WG
        else:
            bar_id, threads = self.dq_full_barrier + buf, DQ_SYNC_THREADS
        if const_expr(wait):
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=threads)
        else:
            cute.arch.barrier_arrive(barrier_id=bar_id, number_of_threads=threads)

    @cute.jit
    def dq_empty(self, buf: Int32, w, wait: cutlass.Constexpr[bool]):
        """bar.sync (a consumer warpgroup, wait) or bar.arrive (the writer) on "dQ empty" of buffer buf --
        and, decoupled, of warpgroup w's share; the id is computed at run time (bar.sync takes it in a
        register)."""
        bar_id = self.dq_empty_barrier + buf
        if const_expr(self.decoupled):
            bar_id = self.dq_empty_barrier + buf * NUM_WG_MMA + w
        if const_expr(wait):
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=self.dq_empty_threads)
        else:
            cute.arch.barrier_arrive(barrier_id=bar_id, number_of_threads=self.dq_empty_threads)

    # -------------------------------------------------------------- consumer warpgroups
    @cute.jit
    def load_row_stats(self, mLSE2: cute.Tensor, mD: cute.Tensor, bidx: Int32, head: Int32, stats_q: Int32,
                       m_block: Int32, seqlen_q: Int32, valid):
        """(lse2, D) of query row m_block * tile_m + r for the consumer threads whose r = stats_row(ctidx)
        < tile_m; +inf and 0 for rows past the sequence, for the other threads, and when not valid (no
        such tile). ctidx is read from %tid.x here, not passed in: kept live across the walk, it
        spilled (80 x 128)."""
        lse2, dpsum = Float32.inf, Float32(0.0)
        r = self.stats_row(thread_idx_fresh() - 128)
        row = m_block * self.tile_m + r
        if valid & (r < self.tile_m) & (row < seqlen_q):
            lse2 = mLSE2[bidx, head, stats_q + row]
            dpsum = mD[bidx, head, stats_q + row]
        return lse2, dpsum

    def stats_row(self, ctidx):
        """The query row (of the tile) whose statistics consumer thread ctidx stages: decoupled, every
        warpgroup stages all rows in its own copy; else the first tile_m consumer threads do."""
        return ctidx % 128 if const_expr(self.decoupled) else ctidx

    @cute.jit
    def next_row_stats(self, walk, mLSE2: cute.Tensor, mD: cute.Tensor, m_block: Int32, head_in_group: Int32,
                       stats_q: Int32):
        """load_row_stats for the tile after m_block in the walk (the next query head's first tile at
        the end of a head; nothing after the last). stats_q is passed in (read from SMEM by the
        caller) rather than taken from the walk, whose copy would stay live in a register."""
        (seqlen_q, seqlen_k, seqlen_k_rows, _, offset_k, bidx, batch, head_kv, n_block,
         m_block_min, m_block_max, qhead_per_kvhead) = walk
        next_m, next_head = m_block + 1, head_in_group
        if next_m == m_block_max:
            next_m, next_head = m_block_min, head_in_group + 1
        return self.load_row_stats(mLSE2, mD, bidx, head_kv * qhead_per_kvhead + next_head, stats_q, next_m,
                                   seqlen_q, next_head < qhead_per_kvhead)

    def stat_tile(self, sStat: cute.Tensor, st) -> cute.Tensor:
        """The row statistics of the tile in pipeline slot st: its stage of the ring with stats_tma, else
        the one copy the consumers staged."""
        return sStat[None, st.index] if const_expr(self.stats_tma) else sStat

    @cute.jit
    def load_quad_stats(self, sStat: cute.Tensor):
        """With stats_shuffle, this lane's 4 statistics (slots 4 lane .. 4 lane + 3: one LDS.128; with
        stats_tma, which keeps the rows in order, queries q0, q0 + 1, q0 + 8, q0 + 9: two LDS.64); else None."""
        if const_expr(not self.stats_shuffle):
            return None
        quad = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        if const_expr(self.stats_tma):
            # the lane from %tid.x again: an address kept live across the walk spilled the d = 64 tile
            lane = thread_idx_fresh() % 32
            q0 = lane // 4 * 16 + lane % 4 * 2
            pairs = cute.make_tensor(sStat.iterator + q0, cute.make_layout((2, 2), stride=(1, 8)))
            cute.autovec_copy(pairs, cute.make_tensor(quad.iterator, cute.make_layout((2, 2), stride=(1, 2))))
        else:
            per_lane = cute.make_tensor(sStat.iterator, cute.make_layout((4, STATS_SHUFFLE_ROWS // 4), stride=(1, 4)))
            cute.autovec_copy(per_lane[None, cute.arch.lane_idx()], quad)
        return quad

    @cute.jit
    def column_stat(self, sStat: cute.Tensor, quad, c: cutlass.Constexpr[int], col: Int32) -> Float32:
        """The statistic of this thread's accumulator column c (query col): shuffled from the lane that
        holds it (stats_shuffle), else read from SMEM."""
        if const_expr(not self.stats_shuffle):
            return sStat[col]
        src_lane, reg = stats_shuffle_source(c, cute.arch.lane_idx())
        return cute.arch.shuffle_sync(quad[reg], src_lane)

    @cute.jit
    def exp_scores(self, acc_S_rc: cute.Tensor, tScS_rc: cute.Tensor, sLSE2: cute.Tensor, lse2_quad,
                   softmax_scale_log2: Float32, key_limit: Int32, diag: Int32, q_rows_left: Int32,
                   masked: cutlass.Constexpr[bool], tScS0_rc: cute.Tensor):
        """P^T = exp2(S^T * scale_log2 - lse2) in place; masked=True also sends masked scores to -inf.
        The walk compiles both versions (its segments): with one body and the test behind a runtime
        `if`, the compiler turned the test into selects that every tile paid (~100 FSEL / ISETP /
        VIADD per tile and warp at d = 128)."""
        if const_expr(masked and self.mask_offsets):
            # every thread's scores sit at the same offsets from its first one (the accumulator layout;
            # tScS0_rc: thread 0's coordinates, static), so score (r, c) is at (row0 + dr, col0 + dc) with
            # dr, dc known here: the causal test row0 + dr > col0 + dc + diag becomes rel_r > dc,
            # rel_r = row0 - col0 - diag + dr, one compare against an immediate per score; a key row past
            # key_limit masks its whole row (rel_r = a bound no dc reaches), a query past the sequence
            # its whole column (lse2 = +inf: its exponentials are 0)
            row0, col0 = tScS_rc[0, 0][0], tScS_rc[0, 0][1]
            rel = [None] * cute.size(acc_S_rc, mode=[0])
            for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
                dr = tScS0_rc[r, 0][0] - tScS0_rc[0, 0][0]
                rel_r = row0 - col0 - diag + dr if const_expr(self.causal) else Int32(-1)
                if row0 + dr >= key_limit:
                    rel_r = Int32(1 << 20)
                rel[r] = rel_r
            cols_left = q_rows_left - col0
        for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
            col = tScS_rc[0, c][1]
            lse2 = self.column_stat(sLSE2, lse2_quad, c, col)
            if const_expr(masked and self.mask_offsets):
                dc = tScS0_rc[0, c][1] - tScS0_rc[0, 0][1]
                if cols_left <= dc:
                    lse2 = Float32.inf
            if const_expr(masked and self.column_limit and not self.mask_offsets):
                # one limit per query column (a query past the sequence masks the whole column), then
                # one compare and select per score
                limit = schedule.column_key_limit(col, key_limit, diag, self.causal, imin=cutlass.min)
                if col >= q_rows_left:
                    limit = Int32(0)
            for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
                s = acc_S_rc[r, c]
                if const_expr(self.key_select and not masked):
                    # never true here (unmasked tiles have every key); ptxas then keeps more of the
                    # exponentials ahead of the dP^T wait, i.e. under the dP^T wgmma (key_select)
                    if schedule.is_masked(tScS_rc[r, c][0], col, key_limit, diag, causal=False):
                        s = -Float32.inf
                if const_expr(masked and self.mask_offsets):
                    if rel[r] > dc:
                        s = -Float32.inf
                elif const_expr(masked and self.column_limit):
                    if tScS_rc[r, c][0] >= limit:
                        s = -Float32.inf
                elif const_expr(masked):
                    if schedule.is_masked(tScS_rc[r, c][0], col, key_limit, diag, self.causal) | (
                            col >= q_rows_left):
                        s = -Float32.inf
                acc_S_rc[r, c] = cute.math.exp2(s * softmax_scale_log2 - lse2, fastmath=True)

    @cute.jit
    def consume(self, walk, ctidx: Int32, storage, mLSE2: cute.Tensor, mD: cute.Tensor, mdK: cute.Tensor,
                mdV: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32,
                tiled_mma_SdP: cute.TiledMma, tiled_mma_dV: cute.TiledMma, tiled_mma_dK: cute.TiledMma,
                tiled_mma_dQ: cute.TiledMma, sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
                sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sdSt_layout: cute.ComposedLayout,
                sdQ_layout: cute.ComposedLayout, gmem_store_dK: cute.TiledCopy, gmem_store_dV: cute.TiledCopy,
                pipe_KV, pipe_Q, pipe_dO, sStat_layout: cute.Layout):
        """The 256 consumer threads (ctidx 0..255); warpgroup w = ctidx // 128 owns keys [64 w, 64 w + 64)."""
        tm, tn, d, dv, stages = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        (seqlen_q, seqlen_k, seqlen_k_rows, offset_q, offset_k, bidx, batch, head_kv, n_block,
         m_block_min, m_block_max, qhead_per_kvhead) = walk
        nthr = NUM_CONSUMER_THREADS
        trace.cta_stamp("start")

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)          # (tm, d, stages)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)      # (tm, dv, stages)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)          # (tn, d)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)          # (tn, dv)
        sdSt = storage.sdSt.get_tensor(sdSt_layout.outer, swizzle=sdSt_layout.inner)  # (tn, tm, ds_buffers)
        sdQ = cute.composition(storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner),
                               self._sdq_tile_view())                             # (tm, d, buffers) fp32
        sQt = cute.composition(sQ, cute.make_ordered_layout((d, tm, stages), order=(1, 0, 2)))
        sdOt = cute.composition(sdO, cute.make_ordered_layout((dv, tm, stages), order=(1, 0, 2)))
        sKt = cute.composition(sK, cute.make_ordered_layout((d, tn), order=(1, 0)))
        sdS = cute.composition(sdSt, cute.make_ordered_layout((tm, tn, self.ds_buffers), order=(1, 0, 2)))

        thr_SdP = tiled_mma_SdP.get_slice(ctidx)
        thr_dV = tiled_mma_dV.get_slice(ctidx)
        thr_dK = tiled_mma_dK.get_slice(ctidx)
        thr_dQ = tiled_mma_dQ.get_slice(ctidx)
        # Shared-memory operands become wgmma descriptors that depend only on the warpgroup: slicing
        # by its first thread, marked warp-uniform, keeps the descriptor arithmetic in uniform
        # registers (sliced by ctidx, every descriptor was rebuilt per thread: ~130 IMAD.MOV / IADD3 /
        # R2UR per tile and warp at d = 128). Accumulators and copies stay sliced by ctidx.
        wg = cute.arch.make_warp_uniform(ctidx // 128)
        wg_first = wg * 128
        wg_SdP, wg_dV = tiled_mma_SdP.get_slice(wg_first), tiled_mma_dV.get_slice(wg_first)
        wg_dK, wg_dQ = tiled_mma_dK.get_slice(wg_first), tiled_mma_dQ.get_slice(wg_first)
        tSrK = wg_SdP.make_fragment_A(wg_SdP.partition_A(sK))         # this warpgroup's 64 keys
        tSrQ = wg_SdP.make_fragment_B(wg_SdP.partition_B(sQ))         # (..., stages)
        tPrV = wg_SdP.make_fragment_A(wg_SdP.partition_A(sV))
        tPrdO = wg_SdP.make_fragment_B(wg_SdP.partition_B(sdO))       # (..., stages)
        tdVrdOt = wg_dV.make_fragment_B(wg_dV.partition_B(sdOt))      # (..., stages)
        tdKrQt = wg_dK.make_fragment_B(wg_dK.partition_B(sQt))        # (..., stages)
        if const_expr(self.dq_swap_ab):  # dQ^T = K^T dS^T: A = K^T (d, tn), B = dS (tm, tn), both MN-major
            tdQrA = wg_dQ.make_fragment_A(wg_dQ.partition_A(sKt))
            tdQrB = wg_dQ.make_fragment_B(wg_dQ.partition_B(sdS))     # (..., ds_buffers)
        else:
            tdQrA = wg_dQ.make_fragment_A(wg_dQ.partition_A(sdS))     # (..., ds_buffers)
            tdQrB = wg_dQ.make_fragment_B(wg_dQ.partition_B(sKt))
        acc_dV = cute.make_rmem_tensor(thr_dV.partition_shape_C((tn, dv)), Float32)
        acc_dK = cute.make_rmem_tensor(thr_dK.partition_shape_C((tn, d)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        tScS_rc = acc_rowcol(thr_SdP.partition_C(cute.make_identity_tensor((tn, tm))))  # (key, query)
        tScS0_rc = acc_rowcol(tiled_mma_SdP.get_slice(0).partition_C(cute.make_identity_tensor((tn, tm))))
        # dS^T (16-bit, accumulator order) -> sdSt: 2 adjacent queries per 4-byte store
        smem_copy_dS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma_SdP)
        thr_smem_dS = smem_copy_dS.get_slice(ctidx)
        tdSsdSt = thr_smem_dS.partition_D(sdSt)                       # (..., ds_buffers)
        # dQ (fp32) -> sdQ[buf]: 2 adjacent columns per 8-byte store; dq_swap_ab holds dQ^T, whose
        # adjacent pair is 2 query rows of sdQ: 4-byte stores into the transposed view
        smem_copy_dQ = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32,
                                num_bits_per_copy=32 if const_expr(self.dq_swap_ab) else 64), tiled_mma_dQ)
        thr_smem_dQ = smem_copy_dQ.get_slice(ctidx)
        if const_expr(self.dq_swap_ab):
            sdQ = cute.composition(sdQ, cute.make_ordered_layout((d, tm, self.dq_buffers), order=(1, 0, 2)))
        dq_shape = (d, tm) if const_expr(self.dq_swap_ab) else (tm, d)
        if const_expr(self.dq_frag):
            # register i of the dQ fragment -> element (i // 4) * 512 + (thread in warpgroup) * 4 + i % 4
            # of the warpgroup's share: 16-byte stores, a warp's 512 bytes contiguous (no conflicts)
            sdQ_frag = storage.sdQ.get_tensor(sdQ_layout.outer)                # (share elems, shares)
            frag_copy = dq_frag_tiled_copy()
            thr_frag = frag_copy.get_slice(ctidx % 128)
            tQsQ_frag = thr_frag.partition_D(sdQ_frag)                          # (4, chunks, shares)
        num_cols = cute.size(tScS_rc, mode=[1])
        stats_len = STATS_SHUFFLE_ROWS if const_expr(self.stats_shuffle) else tm
        copies = NUM_WG_MMA if const_expr(self.decoupled) else 1
        stats_copy = wg if const_expr(self.decoupled) else 0
        if const_expr(self.stats_tma):
            sLSE2 = storage.sLSE2.get_tensor(sStat_layout)                      # (tm, stages), TMA-filled
            sD = storage.sD.get_tensor(sStat_layout)
        else:
            sLSE2 = storage.sLSE2.get_tensor(cute.make_layout((stats_len, copies)))[None, stats_copy]
            sD = storage.sD.get_tensor(cute.make_layout((stats_len, copies)))[None, stats_copy]

        # The epilogue's key offset and row count, and the query offset of the row statistics, wait in
        # SMEM rather than in registers live across the walk: with them there, the d = 64 varlen
        # kernel (128 x 128 tile) spilled. Read back after the first consumer barrier only.
        sOffsets = storage.sOffsets.get_tensor(cute.make_layout(3))
        if ctidx == 0:
            sOffsets[0] = offset_k
            sOffsets[1] = seqlen_k_rows - n_block * tn
            sOffsets[2] = self.stats_offset(offset_q, batch)

        # 1. K_j, V_j (waited for even when the walk is empty: no TMA may outlive the CTA); with
        #    kv_with_first they come with the first tile's Q and dO, and an empty walk loads neither
        if const_expr(not self.kv_with_first):
            pipe_KV.consumer_wait(pipeline.PipelineState(1, Int32(0), Int32(0), Int32(0)))

        # 2. the walk: (query head of the group) x (Q tile)
        n_m = m_block_max - m_block_min
        n_tiles = qhead_per_kvhead * n_m
        trace.note(n_tiles)
        hot_lo, hot_hi = schedule.unmasked_m_range(n_block, tm, tn, seqlen_q, seqlen_k, self.causal, m_block_min,
                                                   m_block_max, imin=cutlass.min, imax=cutlass.max)
        segments = ((m_block_min, hot_lo, True), (hot_lo, hot_hi, False), (hot_hi, m_block_max, True))
        if const_expr(not self.stats_tma):
            lse2_row, dpsum_row = self.load_row_stats(mLSE2, mD, bidx, head_kv * qhead_per_kvhead,
                                                      self.stats_offset(offset_q, batch), m_block_min, seqlen_q,
                                                      n_m > 0)
        for head_in_group in cutlass.range(qhead_per_kvhead, unroll=1):
            # Three segments of the same ascending walk: the Q tiles that need a mask (causal
            # diagonal, a partial last Q tile, a partial K/V tile) run a body compiled with the
            # per-element test, the others a body compiled without it -- no branch inside a body
            # (a uniform `if` there made ptxas serialize every wgmma at d = 64: C7520).
            for seg in cutlass.range_constexpr(3):
                seg_lo, seg_hi, masked = segments[seg]
                for m_block in cutlass.range(seg_lo, seg_hi, unroll=1):
                    t = head_in_group * n_m + m_block - m_block_min
                    st = self.tile_state(t, producer=False)
                    q_rows_left = seqlen_q - m_block * tm

                    # 2a. S^T = K_w Q_i^T as soon as Q_i has landed, dP^T = V_w dO_i^T when dO_i has
                    acc_S = cute.make_rmem_tensor(thr_SdP.partition_shape_C((tn, tm)), Float32)
                    acc_dP = cute.make_rmem_tensor(thr_SdP.partition_shape_C((tn, tm)), Float32)
                    pipe_Q.consumer_wait(st)
                    warpgroup.fence()
                    gemm_issue(tiled_mma_SdP, acc_S, tSrK, tSrQ[None, None, None, st.index], zero_init=True)
                    pipe_dO.consumer_wait(st)
                    gemm_issue(tiled_mma_SdP, acc_dP, tPrV, tPrdO[None, None, None, st.index], zero_init=True)

                    # 2b. row statistics (loaded into registers one tile ahead) into smem while the
                    #     GEMMs run. B1: the statistics are visible, and both warpgroups have finished
                    #     the previous tile (its dQ wgmma read sdSt; its P / dS read sLSE2 / sD).
                    #     Decoupled, B1 is the warpgroup's own (its copy of the statistics; every
                    #     read of the previous tile's precedes B2), and sdSt is guarded apart (2d).
                    #     stats_tma: the producer's TMA brought them with Q_i / dO_i; coupled warpgroups
                    #     still meet at B1 for sdSt.
                    if const_expr(not self.stats_tma):
                        stats_r = self.stats_row(ctidx)
                        if stats_r < tm:
                            slot = stats_slot(stats_r) if const_expr(self.stats_shuffle) else stats_r
                            sLSE2[slot] = lse2_row
                            sD[slot] = dpsum_row
                    if const_expr(self.decoupled):
                        if const_expr(not self.stats_tma):
                            cute.arch.barrier(barrier_id=STATS_BARRIER + wg, number_of_threads=128)
                    else:
                        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=nthr)
                    # stats_shuffle: this lane's 4 lse2 now, so the LDS runs under the S^T wait (ptxas keeps
                    # loads below a wgmma wait): +0..+3% at d = 64, ab_bwd_h100_run13_lse2_quad_early.json
                    sLSE2_t, sD_t = self.stat_tile(sLSE2, st), self.stat_tile(sD, st)  # this tile's statistics
                    lse2_quad = self.load_quad_stats(sLSE2_t)
                    # ... and those of the next tile of the walk: the global load's latency hides
                    # under this tile instead of stalling all 256 threads at B1 (18% of their stall
                    # samples at d = 128 when it was loaded here for this tile). The 128-query tile
                    # (late_dv) loads them after the dQ wait instead, so the two registers are not live
                    # while P^T, dP^T and both accumulators are (its peak; loaded here, it spilled).
                    if const_expr(not self.late_dv and not self.stats_tma):
                        lse2_row, dpsum_row = self.next_row_stats(walk, mLSE2, mD, m_block, head_in_group,
                                                                  sOffsets[2])

                    # 2c. P^T = exp2(S^T * scale_log2 - lse2), masked (keys, causal, queries past the
                    #     sequence: with TMA those rows may hold the next sequence's data)
                    warpgroup.wait_group(1)
                    acc_S_rc = acc_rowcol(acc_S)
                    key_limit, diag = schedule.mask_bounds(m_block, n_block, tm, tn, seqlen_q, seqlen_k)
                    self.exp_scores(acc_S_rc, tScS_rc, sLSE2_t, lse2_quad, softmax_scale_log2, key_limit, diag,
                                    q_rows_left, masked=masked, tScS0_rc=tScS0_rc)
                    # P^T -> 16-bit A fragment of dV (same registers order as the accumulator), dV += P^T dO
                    tdVrPt = cute.make_rmem_tensor(thr_dV.partition_shape_A((tn, tm)), self.dtype)
                    tdVrPt_acc = cute.make_tensor(tdVrPt.iterator, cute.make_layout(acc_S.shape))
                    if const_expr(not self.late_dv):
                        tdVrPt_acc.store(acc_S.load().to(self.dtype))
                        warpgroup.fence()
                        gemm_issue(tiled_mma_dV, acc_dV, tdVrPt, tdVrdOt[None, None, None, st.index], zero_init=False)

                    # 2d. dS^T = P^T * (dP^T - D) -> 16-bit A fragment of dK, and dS^T -> smem for dQ
                    warpgroup.wait_group(0 if const_expr(self.late_dv) else 1)  # dP^T (an early dV may still run)
                    acc_dP_rc = acc_rowcol(acc_dP)
                    dpsum_quad = self.load_quad_stats(sD_t)
                    for c in cutlass.range_constexpr(num_cols):
                        dpsum = self.column_stat(sD_t, dpsum_quad, c, tScS_rc[0, c][1])
                        for r in cutlass.range_constexpr(cute.size(acc_dP_rc, mode=[0])):
                            acc_dP_rc[r, c] = acc_S_rc[r, c] * (acc_dP_rc[r, c] - dpsum)
                    if const_expr(self.late_dv):
                        # P^T packed only now: the fp32 P^T, the 16-bit copy and dP^T are never all live
                        tdVrPt_acc.store(acc_S.load().to(self.dtype))
                    tdKrdSt = cute.make_rmem_tensor(thr_dK.partition_shape_A((tn, tm)), self.dtype)
                    tdSrdS = cute.make_tensor(tdKrdSt.iterator, cute.make_layout(acc_dP.shape))
                    tdSrdS.store(acc_dP.load().to(self.dtype))
                    ds_buf = t % self.ds_buffers
                    if const_expr(self.decoupled and self.ds_buffers == 1):
                        # the other warpgroup's dQ wgmma of the previous tile has read sdSt
                        if t > 0:
                            cute.arch.barrier(barrier_id=SDST_FREE_BARRIER + wg, number_of_threads=nthr)
                    cute.copy(smem_copy_dS, thr_smem_dS.retile(tdSrdS), tdSsdSt[None, None, None, ds_buf])
                    if const_expr(not (self.late_dv and self.dv_before_fence)):
                        cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> wgmma reads
                    if const_expr(self.late_dv):
                        warpgroup.fence()
                        gemm_issue(tiled_mma_dV, acc_dV, tdVrPt, tdVrdOt[None, None, None, st.index], zero_init=False)
                    if const_expr(self.late_dv and self.dv_before_fence):
                        # dV reads registers and dO: only the dQ wgmma after B2 reads sdSt
                        cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=nthr)  # B2

                    # 2e. dQ_i = dS K_j (this warpgroup's d/2 columns, or its 64 query rows when
                    #     dq_split_m), then dK += dS^T Q_i: dQ goes
                    #     first so that its registers -> smem hand-off below runs under dK's wgmma.
                    acc_dQ = cute.make_rmem_tensor(thr_dQ.partition_shape_C(dq_shape), Float32)
                    warpgroup.fence()
                    if const_expr(self.dq_swap_ab):
                        gemm_issue(tiled_mma_dQ, acc_dQ, tdQrA, tdQrB[None, None, None, ds_buf], zero_init=True)
                    else:
                        gemm_issue(tiled_mma_dQ, acc_dQ, tdQrA[None, None, None, ds_buf], tdQrB, zero_init=True)
                    gemm_issue(tiled_mma_dK, acc_dK, tdKrdSt, tdKrQt[None, None, None, st.index], zero_init=False)
                    warpgroup.wait_group(1)  # dV and dQ done, dK may run
                    if const_expr(self.decoupled and self.ds_buffers == 1):
                        if t + 1 < n_tiles:  # this warpgroup's dQ has read sdSt: the other may overwrite it
                            cute.arch.barrier_arrive(barrier_id=SDST_FREE_BARRIER + NUM_WG_MMA - 1 - wg,
                                                     number_of_threads=nthr)
                    # dP^T and dV have read dO_i: its stage goes back now, not after dK (the official
                    # kernel's order; +2.5..+3.8% at d = 128, ab_bwd_h100_run3_early_do_release.json)
                    pipe_dO.consumer_release(st)
                    if const_expr(self.late_dv and not self.stats_tma):
                        lse2_row, dpsum_row = self.next_row_stats(walk, mLSE2, mD, m_block, head_in_group,
                                                                  sOffsets[2])

                    # 2f. hand dQ_i to the writer warp: sdQ[buf] free (t >= 2) -> store -> proxy fence -> arrive
                    buf = t % self.dq_buffers
                    if t >= self.dq_buffers:
                        self.dq_empty(buf, wg, wait=True)
                    if const_expr(self.dq_frag):
                        dst = tQsQ_frag[None, None, buf * NUM_WG_MMA + wg]
                        cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, dst.layout.shape), dst)
                    else:
                        cute.copy(smem_copy_dQ, thr_smem_dQ.retile(acc_dQ), thr_smem_dQ.partition_D(sdQ[None, None, buf]))
                    cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> bulk-copy reads
                    self.dq_full(buf, wg, wait=False)
                    warpgroup.wait_group(0)  # dK has read Q_i: the Q/dO stage goes back
                    pipe_Q.consumer_release(st)
                    trace.stamp(t, "end")  # no code unless trace_bwd.py --tile-stamps

        trace.cta_stamp("walked")
        # 3. epilogue: dK *= scale; registers -> smem (over sK / sV) -> 16-byte row-guarded stores.
        #    The barrier: both warpgroups' last wgmmas (readers of sK, sV) have completed.
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=nthr)
        acc_dK.store(acc_dK.load() * softmax_scale)
        offset_k, k_rows_left = sOffsets[0], sOffsets[1]
        ctidx = thread_idx_fresh() - 128  # re-read: values derived from it, kept across the walk, spilled
        self.store_tile(acc_dK, tiled_mma_dK, sK, gmem_store_dK, ctidx,
                        cute.local_tile(cute.domain_offset((offset_k, 0), mdK[bidx, None, head_kv, None]),
                                        (tn, d), (n_block, 0)), (tn, d), k_rows_left)
        self.store_tile(acc_dV, tiled_mma_dV, sV, gmem_store_dV, ctidx,
                        cute.local_tile(cute.domain_offset((offset_k, 0), mdV[bidx, None, head_kv, None]),
                                        (tn, dv), (n_block, 0)), (tn, dv), k_rows_left)
        trace.cta_stamp("end")


# ------------------------------------------------------------------------------------------------
# Host API (shared with steps 1 and 2 through host.py)
# ------------------------------------------------------------------------------------------------
def _check_dims_of(q, v):
    """Refuse unsupported head dims before host.backward launches the preprocess."""
    if hasattr(q, "shape") and hasattr(v, "shape") and len(q.shape) >= 3 and len(v.shape) >= 3:
        common.check_head_dims(q.shape[-1], v.shape[-1])
        check_rs_head_dims(q.shape[-1], v.shape[-1])


def make_kernel(dtype, head_dim, head_dim_v, causal, deterministic, *, varlen=False, has_seqused_k=False,
                dq_order=None, tiles=None, **options):
    """options: late_dv / dq_split_m overrides (experiments; the callers of this module pass none)."""
    tm, tn = tiles if tiles is not None else (None, None)
    return FlashAttentionBackwardSm90Step3(dtype, head_dim, head_dim_v, causal, deterministic, varlen=varlen,
                                           has_seqused_k=has_seqused_k, tile_m=tm, tile_n=tn, dq_order=dq_order,
                                           **options)


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, varlen=False,
                 has_seqused_k=False, dq_order=None, tiles=None, **options) -> common.Compiled:
    """Compile for sm_90a with fake tensors (no GPU needed); returns the compiled kernel + report.
    options: constructor options (e.g. key_select=False), built under ab_bwd.py's variant name
    (``STEP~key_select=0``), so they never share a cache entry with the defaults."""
    import functools

    from stage4_bwd_kernel import host

    name = STEP + "".join(f"~{k}={int(v)}" for k, v in sorted(options.items()))
    return host.compile_fake(name, functools.partial(make_kernel, **options), dtype=dtype, head_dim=head_dim,
                             head_dim_v=head_dim if head_dim_v is None else head_dim_v, causal=causal,
                             deterministic=deterministic, varlen=varlen, has_seqused_k=has_seqused_k,
                             dq_order=dq_order, tiles=tiles)


def attention_backward(q, k, v, out, dout, lse, *, softmax_scale=None, causal=False, deterministic=False,
                       dq=None, dk=None, dv=None, dq_order=None, tiles=None):
    """(B,S,H,D) CUDA fp16/bf16 q, k, v, out, dout and lse (B,Hq,Sq) fp32 -> (dq, dk, dv)."""
    from stage4_bwd_kernel import host

    _check_dims_of(q, v)
    return host.backward(STEP, make_kernel, q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal,
                         deterministic=deterministic, dq=dq, dk=dk, dv=dv, dq_order=dq_order, tiles=tiles)


def attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              seqused_k=None, softmax_scale=None, causal=False, deterministic=False,
                              dq_order=None, tiles=None):
    """Packed (T,H,D) q, k, v, out, dout, lse (Hq, Tq) fp32, int32 cu_seqlens -> (dq, dk, dv)."""
    from stage4_bwd_kernel import host

    _check_dims_of(q, v)
    return host.backward(STEP, make_kernel, q, k, v, out, dout, lse, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal,
                         deterministic=deterministic, dq_order=dq_order, tiles=tiles)


def run(batch=2, seqlen_q=1024, seqlen_k=None, heads=8, heads_kv=None, head_dim=128, head_dim_v=None,
        causal=False, deterministic=False, dtype="bf16", check=True, compare_deterministic=True, verbose=True):
    """On a Hopper GPU: check against autograd (FA4 rule), time, and time deterministic vs default.
    Otherwise: compile for sm_90a and print the resource report."""
    from stage4_bwd_kernel import host

    return host.run_step(STEP, compile_only, attention_backward, batch=batch, seqlen_q=seqlen_q,
                         seqlen_k=seqlen_q if seqlen_k is None else seqlen_k, heads=heads,
                         heads_kv=heads if heads_kv is None else heads_kv, head_dim=head_dim,
                         head_dim_v=head_dim if head_dim_v is None else head_dim_v, causal=causal,
                         deterministic=deterministic, dtype=dtype, check=check,
                         compare_deterministic=compare_deterministic, verbose=verbose)


if __name__ == "__main__":
    from stage4_bwd_kernel import host

    host.cli(run, __doc__)
