"""Base config every experiment starts from: synchronous DiLoCo on the embedded synthetic language.

Other configs import this one and change what they study. Run it directly with
  python -m experiments.train --config=configs/default.py --workdir=/tmp/dd_default
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Defaults follow DiLoCo (arXiv 2311.08105) scaled down to a CPU-sized model."""
  config = ml_collections.ConfigDict()
  config.mode = "diloco"  # 'diloco' (synchronous rounds), 'decoupled' (asynchronous syncer) or 'ddp' (one group).
  config.runtime = "lockstep"  # 'lockstep' (rounds, wall clock), 'sim' (virtual clock with hardware profiles) or 'threads' (real time, a thread per group).
  config.seed = 0  # Seeds model init, data shards and synthetic data: same seed, same metrics.
  config.outer_steps = 10  # Outer rounds (DiLoCo syncs); for ddp, rounds of inner_steps between evals.
  config.inner_steps = 20  # H: inner AdamW steps per learner between syncs (must be >= 1).

  config.model = ml_collections.ConfigDict()
  config.model.vocab_size = 256  # Follows data.tokenizer: 256 for bytes, a SentencePiece model's own size otherwise.
  config.model.seq_len = 64  # Tokens of context per training window.
  config.model.d_model = 64  # Residual stream width.
  config.model.num_layers = 2  # Transformer blocks.
  config.model.num_heads = 4  # Attention heads (must divide d_model).
  config.model.d_ff = 256  # MLP hidden width.
  config.model.dtype = "float32"  # Compute dtype ('float32' or 'bfloat16'); params stay float32.
  # Architecture options (docs/scale.md); the defaults are the GPT-2-style model.
  config.model.position = "learned"  # 'learned' position table or 'rope' (rotary; no position params).
  config.model.rope_theta = 10_000.0  # RoPE base wavelength (position='rope' only).
  config.model.mlp = "gelu"  # 'gelu' (two matrices) or 'swiglu' (gated, three matrices; Llama/Gemma).
  config.model.num_kv_heads = 0  # Key/value heads for grouped-query attention; 0 = num_heads (plain multi-head).
  config.model.tie_embeddings = False  # Output projection = token embedding transposed (no lm_head params).
  # How it runs (same function, different memory/compile time/speed):
  config.model.attention = "xla"  # 'xla', 'dot_product' (cuDNN on GPU), 'splash' (Pallas TPU) or 'auto'.
  config.model.remat = "none"  # Per-block remat: 'none', 'full', 'dots_saveable', 'minimal' or 'offload' (host).
  config.model.scan_layers = False  # One compiled block scanned over the layers: compile time flat in depth.
  config.model.document_eod_id = -1  # Set from data.mask_document_boundaries (the tokenizer's id); leave at -1.
  config.model.loss_chunk = 0  # Tokens per cross-entropy chunk: no [B, T, vocab] f32 logits (0 = no chunks).
  # Mixture of experts (docs/moe.md): num_experts 0 = dense; the other fields only with num_experts > 0.
  config.model.moe = ml_collections.ConfigDict()
  config.model.moe.num_experts = 0  # E: expert MLPs per MoE block (0 = dense model).
  config.model.moe.top_k = 2  # k: experts each token is routed to; their gates are renormalised to sum to 1.
  config.model.moe.capacity_factor = 1.25  # c: ceil(k*T*c/E) slots/expert/sequence, overflow dropped; 0 = dropless.
  config.model.moe.every = 1  # MoE in every n-th block (blocks n-1, 2n-1, ...); others dense. >1 needs scan_layers off.
  config.model.moe.d_ff = 0  # Hidden width of one expert (0 = model.d_ff).
  config.model.moe.shared_experts = 0  # Always-on experts per MoE block (one MLP of shared_experts x d_ff wide).
  config.model.moe.aux_loss_weight = 0.01  # Weight of the load-balancing loss (Switch/GShard), mean over MoE blocks.
  config.model.moe.z_loss_weight = 0.001  # Weight of the router z-loss (ST-MoE), mean over MoE blocks.

  config.data = ml_collections.ConfigDict()
  config.data.source = "synthetic"  # 'synthetic' (embedded, known optimum), 'text_file', 'array_record' or 'tfds'.
  config.data.path = ""  # Text file (source='text_file') or experiments.prepare_data output dir ('array_record').
  config.data.tokenizer = "byte"  # 'byte' (embedded, 256 ids) or 'sentencepiece' (data.tokenizer_path).
  config.data.tokenizer_path = ""  # SentencePiece .model (python -m experiments.train_tokenizer makes one).
  config.data.chunk_bytes = 4096  # Long texts of few-document sources are dealt out in pieces of about this size.
  config.data.mask_document_boundaries = False  # Packed documents: attention segmented at end-of-document tokens.
  config.data.prefetch = 2  # Packed batches each learner's grain pipeline prepares ahead in a worker thread (0 = none).
  config.data.tfds_name = ""  # TFDS dataset for source='tfds', e.g. 'tiny_shakespeare', 'lm1b'.
  config.data.tfds_data_dir = ""  # TFDS data_dir ('' = TFDS's default, ~/tensorflow_datasets).
  config.data.tfds_text_key = "text"  # Feature holding the text in each TFDS example.
  config.data.split = "iid"  # How windows are dealt to learners: 'iid' (shuffled) or 'noniid' (contiguous).
  config.data.eval_fraction = 0.1  # Held-out tail for sources without an eval split.
  config.data.synthetic = ml_collections.ConfigDict()
  config.data.synthetic.alphabet_size = 16  # Distinct symbols of the synthetic language.
  config.data.synthetic.order = 2  # Markov order: each symbol depends on the previous `order` symbols.
  config.data.synthetic.concentration = 0.1  # Dirichlet concentration of transition rows; lower = lower entropy.
  config.data.synthetic.num_tokens = 2_000_000  # Training tokens generated (eval gets a separate ~10%).
  config.data.synthetic.seed = 1234  # Which language: fixed apart from config.seed so runs share a task.

  config.learners = ml_collections.ConfigDict()
  config.learners.devices = (2, 2, 2, 2)  # Devices per learner group; groups get disjoint device slices.
  config.learners.batch_size = (16, 16, 16, 16)  # Sequences per inner step per group (divisible by its devices).
  config.learners.fsdp = False  # Also shard params and AdamW moments over each group's devices (when layouts is ()).
  config.learners.layouts = ()  # Per-group mesh, e.g. ('fsdp=8,tensor=2', 'data=4,fsdp=4') (docs/plan.md); () = fsdp.
  config.learners.hardware = ()  # Per-group chip (hardware.ACCELERATORS: v4, v5e, v5p, v6e, a100, h100, h100_pcie,
  # h200, b200, l40s) or 'relative'; () = all relative.
  config.learners.chips = ()  # Per-group chips of the simulated slice; () = the group's device count.
  config.learners.speed = ()  # Per-group relative speed for 'relative' hardware; () = all 1.0.
  config.learners.mfu = 0.4  # Model FLOPs utilisation of every simulated TPU slice.
  config.learners.jitter = 0.0  # Log-std of per-step time noise in the simulation (0 = none).
  # Wall-clock runtimes (threads, service): group m sleeps slowdown[m] x each step's time after it, emulating
  # slower chips on one machine.
  config.learners.slowdown = ()  # Per-group sleep factor; () = none.

  config.inner = ml_collections.ConfigDict()
  config.inner.optimizer = "adamw"  # 'adamw' (DiLoCo) or 'muon' (block matrices; AdamW the rest: MuLoCo).
  config.inner.lr = 3e-3  # Peak AdamW learning rate (DiLoCo uses 4e-4 at 150M params); Muon's too (consistent RMS).
  config.inner.warmup_steps = 50  # Linear warmup steps, counted per learner.
  config.inner.final_lr_fraction = 0.1  # Cosine decays to this fraction of lr at the last step.
  config.inner.weight_decay = 0.1  # Decoupled weight decay x lr (AdamW: matrices only; Muon: every leaf, as optax).
  config.inner.clip_norm = 1.0  # Global gradient-norm clip.
  config.inner.b1 = 0.9  # AdamW beta1 (also of Muon's AdamW half).
  config.inner.b2 = 0.95  # AdamW beta2 (also of Muon's AdamW half).
  config.inner.microbatches = 1  # Gradient accumulation over k microbatches (batch % (k x devices) == 0).
  config.inner.muon_beta = 0.95  # Muon's Nesterov momentum (optimizer='muon' only, as the muon_* fields).
  config.inner.muon_ns_steps = 5  # Newton-Schulz iterations orthogonalising each matrix's update.
  config.inner.muon_consistent_rms = 0.2  # Update x 0.2 sqrt(max(fan_in, fan_out)): AdamW's RMS (0 = width scaling).

  config.outer = ml_collections.ConfigDict()
  # 'auto' (and buffer_size 0, policy.kind 'auto'): the mode's recipe, decoupled_diloco/mode_defaults.py.
  config.outer.optimizer = "auto"  # 'sgd' (momentum / Nesterov), 'adam', 'delayed_nesterov'; auto: DN if decoupled.
  config.outer.lr = 0.7  # Outer learning rate (DiLoCo: 0.7; 1.0 without momentum = parameter averaging).
  config.outer.momentum = 0.9  # Outer momentum, Adam's b1 for optimizer='adam' (0 = none).
  config.outer.nesterov = True  # Nesterov momentum (DiLoCo's choice).
  config.outer.buffer_size = 0  # Delayed Nesterov: N pushes per momentum update; 0 = a round's pushes (M).
  config.outer.activation = 0.0  # Delayed Nesterov: c in [0, 1/buffer_size], momentum share between updates.

  config.syncer = ml_collections.ConfigDict()  # Merge policy (docs/syncer.md); mode='diloco': quorum all, staleness 0.
  config.syncer.quorum = -1  # K: distinct learners that must report before a merge (0 = all; -1 = auto: 1 if decoupled).
  config.syncer.grace_gamma = -1.0  # γ of the adaptive grace window (0 = merge once K reported; -1 = auto: 0.9 if decoupled).
  config.syncer.grace_overlap_steps = -1.0  # τ: steps of slack before learners need Θ (sizes the window; -1 = auto: 2).
  config.syncer.staleness = "polynomial"  # 'constant', 'polynomial' (1+s)^-a, 'hinge' or 'exponential' exp(-a s).
  config.syncer.staleness_a = 0.5  # a of the staleness function.
  config.syncer.staleness_b = 0.0  # b of the hinge function (staleness tolerated at full weight).
  config.syncer.max_staleness = -1  # Drop (and count) pushes staler than this; -1 = keep all.
  config.syncer.token_weighting = "tokens"  # 'none', 'tokens' or 'tokens_squared_per_step' (Decoupled DiLoCo).
  config.syncer.merge_rule = "mean"  # 'mean', 'rda' (radial-directional), or robust: 'clip', 'trimmed_mean'.
  config.syncer.clip_multiple = 2.0  # clip: each push scaled to at most this × the median of recent push norms.
  config.syncer.clip_window = 16  # clip: that median is over this push and the clip_window - 1 accepted before it.
  config.syncer.trim_fraction = 0.125  # trimmed_mean: share of a merge's pushes trimmed at each end per coordinate.
  config.syncer.max_push_norm = 0.0  # Refuse (and count) a push whose decoded norm exceeds this; 0 = no bound.
  config.syncer.min_learners_to_start = 0  # Service: joins wait until this many learners joined (0 = all configured).
  config.syncer.start_timeout_seconds = 600.0  # Service: start with those joined after this long (a 'start' record).

  config.policy = ml_collections.ConfigDict()  # Local work per push (virtual-clock and threads runtimes).
  config.policy.kind = "auto"  # 'fixed' (H steps), 'dylu' (H scaled by speed), 'time_budget'; auto: dylu if decoupled.
  config.policy.speed_source = "declared"  # DyLU speeds: 'declared' (hardware) or 'measured' (EMA of steps).
  config.policy.round_seconds = 0.0  # Time budget of a round in (virtual) seconds, for 'time_budget'.
  config.policy.dylu_rounding = "floor"  # DyLU steps ⌊v/max v·H⌋ ('floor', the paper) or 'nearest' step.

  config.sim = ml_collections.ConfigDict()  # Virtual clock.
  config.sim.reference_step_seconds = 1.0  # Step time at relative speed 1.0.
  config.sim.simulated_params = 0  # Time compute and transfers as if the model had this many params (0 = real).
  config.sim.simulated_tokens_per_step = 0  # Time each inner step as if its batch had this many tokens (0 = real).
  config.sim.link_latency_seconds = 0.0  # One-way latency between a learner and the syncer.
  config.sim.link_gbps = 0.0  # Link bandwidth in Gbit/s (0 = unlimited).
  config.sim.learner_link_gbps = ()  # Per-learner link Gbit/s overriding link_gbps; () = link_gbps for all.
  config.sim.learner_link_latency_seconds = ()  # Per-learner one-way latency overriding link_latency_seconds.
  config.sim.seed = 0  # Seeds step-time jitter.

  config.failures = ml_collections.ConfigDict()  # Chip failures on the virtual clock (runtime/failures.py; sim only).
  config.failures.enabled = False  # Inject seeded failures into the run's learner groups (modes 'decoupled' and 'ddp').
  config.failures.mtbi_seconds = 365 * 24 * 3600.0  # Per-chip mean time between interruptions (virtual seconds).
  config.failures.restart_seconds = 60.0  # Mean (exponential) downtime of a restart: decoupled learner, non-elastic ddp.
  config.failures.resize_seconds = 20.0  # Mean pause of an elastic ddp job dropping a failed domain.
  config.failures.domain_chips = 256  # Elastic ddp: chips one failure takes out (its replica).
  config.failures.repair_seconds = 3600.0  # Elastic ddp: until a failed domain is back.
  config.failures.elastic = False  # ddp only: continue on fewer chips after a resize (False = stop and restart).
  config.failures.checkpoint_every = 1  # Periods (H steps) between a learner's checkpoints of its inner state.
  config.failures.seed = 0  # Seeds the failure trace and downtimes.
  config.failures.byzantine_learner = -1  # Corrupt this learner's pushes (runtime/byzantine.py; sim, threads); -1: off
  config.failures.byzantine_kind = "scaled"  # 'scaled' (x byzantine_scale), 'flipped' (-Δ), 'noise' (Δ's norm).
  config.failures.byzantine_scale = 100.0  # 'scaled': the factor.

  config.streaming = ml_collections.ConfigDict()  # Streaming DiLoCo: sync one fragment at a time.
  config.streaming.num_fragments = 1  # P: fragments of the params, each synced once per H steps (1 = whole model).
  config.streaming.strategy = "strided"  # 'strided' (layer i -> fragment i mod P), 'tensor' (round-robin) or 'balanced' (bin-packing by bytes).
  config.streaming.overlap_steps = 0  # tau: inner steps a learner keeps training before the merged fragment must be in (0 = wait).
  config.streaming.alpha = 0.0  # alpha: theta_p <- alpha * theta_p(local) + (1 - alpha) * Theta_p(new) (0 = take the merge).

  config.compression = ml_collections.ConfigDict()  # Pseudo-gradients on the wire (learner -> syncer).
  config.compression.format = "fp32"  # 'fp32', 'bf16', 'int8', 'int4', 'fp4' (E3M0), 'int2' or 'topk'.
  config.compression.block_size = 64  # Values per absmax scale of the int/fp4 formats.
  config.compression.topk_fraction = 0.01  # Fraction of each tensor's entries that 'topk' sends.
  config.compression.error_feedback = False  # Keep what compression lost and add it to the next push.
  config.compression.error_feedback_beta = 1.0  # beta of e <- beta * e + delta (1 = keep everything).
  config.compression.downlink_format = "fp32"  # Theta_p sent back to learners: 'fp32' or 'bf16' (syncer keeps fp32).

  # The syncer as a gRPC service, learners as processes (--role=syncer|learner).
  config.service = ml_collections.ConfigDict()
  config.service.host = "127.0.0.1"  # Address the syncer binds: this machine only unless set (e.g. 0.0.0.0, then use TLS).
  config.service.port = 0  # Syncer port; 0 = a free one, written to <workdir>/syncer_address.
  config.service.data_port = 0  # Push payloads' TCP data channel (gRPC issues tickets); 0 = a free one, -1 = off.
  config.service.token_file = ""  # File holding the shared secret ('' = $DD_SYNCER_TOKEN); never put it on a command line.
  config.service.tls_cert = ""  # Syncer's PEM certificate; with tls_key it serves TLS ('' = plaintext).
  config.service.tls_key = ""  # Syncer's PEM private key.
  config.service.tls_ca = ""  # PEM a learner trusts for the syncer's certificate ('' = plaintext channel).
  config.service.chunk_bytes = 4 << 20  # Bytes per streamed message; gRPC refuses messages above this + 64 KiB.
  config.service.checkpoint_every_merges = 10  # Merges between syncer checkpoints (its write-ahead log covers the rest).
  config.service.local_dir = ""  # Local disk for the write-ahead log and locks; '' = the workdir (then not gs://).
  config.service.truncate_corrupt_log = False  # Start despite a corrupt log record, dropping it and all after it.
  config.service.lease_seconds = 30.0  # A learner silent this long leaves the quorum until its next call.
  config.service.linger_seconds = 120.0  # A finished syncer keeps telling learners 'done' this long (or until all heard).
  config.service.rpc_timeout_seconds = 120.0  # Deadline of one call (a whole push or pull stream).
  config.service.retry_seconds = 300.0  # A learner exits after the syncer was unreachable this long.
  config.service.keepalive_seconds = 20.0  # The syncer pings a connection silent this long...
  config.service.keepalive_timeout_seconds = 10.0  # ...and closes it (ending its calls) if unanswered this long.
  config.service.max_concurrent_rpcs = 256  # Calls in the syncer at once (running + queued); more: retried.
  config.service.link_mbps = ()  # Per-learner Mbps pacing its data-channel traffic both ways in real time (() = none).
  config.service.link_latency_ms = ()  # Per-learner one-way latency added to each data-channel transfer (() = none).
  config.service.learner_checkpoint_every = 5  # Rounds between a learner's checkpoints of its inner state (0 = never).
  config.service.max_refusals_in_a_row = 8  # Refused pushes in a row after which a learner process stops (exit 1).
  # "syncer": its host CPU runs model.loss on the eval batches (small models only: refused above 100M params);
  # "evaluator": a --role=evaluator process reads Θ like a learner and evaluates it on its own devices
  # (<workdir>/evaluator/metrics.jsonl; docs/evaluation.md); "none": no eval records. Only "syncer" runs the
  # model on the syncer's host.
  config.service.evaluate_on = "syncer"  # Where the service evaluates Θ: "syncer", "evaluator" or "none".
  config.service.evaluator_devices = 0  # The evaluator's devices: 0 = learner group 0's (and its layout), N = fsdp=N.
  config.service.shards = 1  # S syncers, each owning fragments balanced by bytes (1 <= S <= streaming.num_fragments).

  config.eval_every = 1  # Evaluate the global params every this many outer steps (and at the end).
  # A run is diverged (it stops, says so, exits 3) at a non-finite eval loss or after N evals in a row above the
  # untrained model's loss ln(vocab_size) (run/monitor.py).
  config.divergence_evals = 3  # N; 0 = only a non-finite eval loss is a divergence.
  config.eval_batches = 4  # Held-out batches per evaluation.
  config.eval_batch_size = 32  # Sequences per eval batch.
  config.log_every = 10  # Inner steps between train-loss records.
  config.checkpoint_every = 5  # Outer steps between orbax checkpoints (sim: rounds' worth of tokens) and at the end.
  config.resume = False  # Continue from the latest checkpoint in --workdir (runtimes lockstep and sim).
  return config.lock()  # Setting a field default.py lacks (a typo) raises: no field is added unread.
