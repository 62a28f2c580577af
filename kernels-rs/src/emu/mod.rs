//! Host SIMT emulator: runs the kernels, unchanged, on the CPU.
//!
//! [`launch`] plays every GPU thread of a block on a stack of its own, so barriers and
//! warp collectives really wait for each other. The blocks of the grid run one after
//! another. Warp collectives go through a per-warp exchange (`warp.rs`: semantics and
//! misuse rules), `mma_*` use the PTX ISA fragment layouts and accumulate in f64
//! (`mma.rs`), and shared memory is bounds- and race-checked (`smem.rs`: the race model).
//!
//! The stacks belong to *workers*, which a [`Carrier`] provides (`block.rs` schedules
//! them; both carriers detect exactly the same misuse):
//! - [`Carrier::Fibers`] (the default, on x86-64 Linux; `fiber.rs`): fibers on the
//!   calling thread, one GPU thread running at a time, switched by the emulator in
//!   nanoseconds;
//! - [`Carrier::Threads`] (`pool.rs`): OS threads from a persistent pool, as many running
//!   at once as the host has cores, woken one by one (each wait is an OS context switch).
//!
//! GPU threads start lazily, in order, and a worker whose GPU thread returns runs the
//! next one, so a kernel that never waits runs on one worker (fibers) or a few (threads)
//! without any switch. Set `SPARSEKIT_EMU_CARRIER=threads` to make [`launch`] use
//! threads, or call [`launch_with`].
//!
//! Misuse is reported, never left to hang: a barrier some threads will never reach
//! (they returned), a warp collective whose mask names missing or exited lanes or whose
//! lanes disagree, shared memory out of bounds or racing, and any panic in kernel code.
//! The first problem found stops every thread of the launch and becomes its
//! [`EmuError`].
//!
//! ```
//! use sparsekit_kernels::emu::{launch, Emu, EmuError, LaunchConfig, Params};
//! use sparsekit_kernels::simt::Simt;
//!
//! #[derive(Clone, Copy)]
//! struct Args {
//!     out: *mut u32,
//! }
//!
//! /// Writes, for each block, the sum of its thread indices.
//! ///
//! /// # Safety
//! /// `out` holds `grid_dim` elements.
//! unsafe fn block_sum<S: Simt>(args: Args) {
//!     let t = S::thread_idx();
//!     // SAFETY: one u32 per thread of a block launched with 4 * block_dim smem bytes.
//!     unsafe { S::smem_store(4 * t as usize, t) };
//!     S::sync_threads();
//!     if t == 0 {
//!         let mut sum = 0;
//!         for i in 0..S::block_dim() {
//!             // SAFETY: written above, before the barrier.
//!             sum += unsafe { S::smem_load::<u32>(4 * i as usize) };
//!         }
//!         // SAFETY: one element per block.
//!         unsafe { *args.out.add(S::block_idx() as usize) = sum };
//!     }
//! }
//!
//! let mut out = vec![0u32; 3];
//! // SAFETY: each block writes its own element of `out`, which outlives the launch.
//! let args = unsafe { Params::new(Args { out: out.as_mut_ptr() }) };
//! let cfg = LaunchConfig { grid: 3, block: 64, dyn_smem_bytes: 64 * 4 };
//! // SAFETY: `out` has `grid` elements; shared memory holds `block` u32s.
//! launch(cfg, || unsafe { block_sum::<Emu>(args.get()) })?;
//! assert_eq!(out, [2016; 3]);
//! # Ok::<(), EmuError>(())
//! ```

mod barrier;
mod block;
mod error;
mod fiber;
mod global;
mod mma;
mod pool;
mod profile;
mod smem;
mod warp;

use std::cell::{Cell, RefCell};
use std::mem::{size_of, MaybeUninit};
use std::panic::{self, AssertUnwindSafe, Location};
use std::rc::Rc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use crate::global::{GlobalMut, GlobalPtr, Word};
use crate::launch::KernelParams;
use crate::simt::Simt;

use block::{BlockSync, KernelRef, LaunchSetup, Next, Stop};
pub use error::{EmuError, RaceKind};
use global::GlobalCheck;
pub use global::{BufferAccess, GlobalAccessError, GlobalBuffers, GlobalFault, GlobalOp};
use mma::MmaFragments;
use pool::{Job, Worker};
pub use profile::{Profile, SiteProfile, Space};
use profile::{ThreadTrace, Tracer};
use smem::Accessor;
pub use smem::SMEM_POISON;
pub use warp::SHFL_UNDEFINED;
use warp::{Input, Kind};

/// Most threads in a block.
pub const MAX_BLOCK_THREADS: u32 = 1024;
/// Most dynamic shared memory of a block (228 KiB, as on sm_90 / sm_120 with opt-in).
pub const MAX_DYN_SMEM_BYTES: usize = 228 * 1024;
/// Most blocks in a (one-dimensional) grid.
pub const MAX_GRID_BLOCKS: u32 = i32::MAX as u32;

/// The shape of a one-dimensional launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// `gridDim.x`: blocks, at least 1.
    pub grid: u32,
    /// `blockDim.x`: threads per block, 1 to [`MAX_BLOCK_THREADS`].
    pub block: u32,
    /// Dynamic shared memory per block in bytes, at most [`MAX_DYN_SMEM_BYTES`].
    pub dyn_smem_bytes: usize,
}

impl LaunchConfig {
    /// Checks the configuration against the hardware limits.
    pub fn validate(&self) -> Result<(), EmuError> {
        let detail = if self.grid == 0 || self.grid > MAX_GRID_BLOCKS {
            format!(
                "grid of {} blocks (must be 1..={MAX_GRID_BLOCKS})",
                self.grid
            )
        } else if self.block == 0 || self.block > MAX_BLOCK_THREADS {
            format!(
                "block of {} threads (must be 1..={MAX_BLOCK_THREADS})",
                self.block
            )
        } else if self.dyn_smem_bytes > MAX_DYN_SMEM_BYTES {
            format!(
                "{} bytes of dynamic shared memory (at most {MAX_DYN_SMEM_BYTES})",
                self.dyn_smem_bytes
            )
        } else {
            return Ok(());
        };
        Err(EmuError::InvalidConfig { detail })
    }
}

/// Kernel parameters shared by all emulated threads of a launch.
///
/// Kernel parameter structs hold raw pointers, which are neither `Send` nor `Sync`, while
/// [`launch`] runs the kernel closure on many threads. Wrap the parameters once, then call
/// [`Params::get`] inside the closure (the closure must capture the wrapper, not a field
/// of it, which is why the field is private):
/// `launch(cfg, || unsafe { kernel::<Emu>(params.get()) })`.
#[derive(Debug, Clone, Copy)]
pub struct Params<T>(T);

impl<T: Copy> Params<T> {
    /// Wraps kernel parameters for use from all emulated threads.
    ///
    /// # Safety
    /// Using copies of `value` from several threads at once must be sound: whatever it
    /// points to must stay valid for the launch, and the kernel's accesses through it must
    /// not race (exactly the requirements of a GPU launch).
    pub unsafe fn new(value: T) -> Self {
        Self(value)
    }

    /// A copy of the parameters.
    pub fn get(&self) -> T {
        self.0
    }
}

// SAFETY: `Params::new` is unsafe and its caller promises that sharing copies of the value
// across threads is sound; `Params` gives out nothing but copies.
unsafe impl<T: Copy> Sync for Params<T> {}
// SAFETY: as for `Sync`.
unsafe impl<T: Copy> Send for Params<T> {}

/// How [`launch_with`] runs the GPU threads of a launch. Both carriers give every GPU
/// thread a stack of its own, so barriers and collectives really wait, and both detect
/// the same misuse in the same way; they differ only in speed and in how threads
/// interleave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carrier {
    /// Fibers (stacks switched by the emulator itself) on the calling thread, one GPU
    /// thread at a time: a switch costs nanoseconds, so collectives and barriers are
    /// cheap. A GPU thread spinning on an atomic yields to the others every few
    /// [`Simt::atomic_add_u32`] calls. Only on x86-64 Linux; elsewhere
    /// [`Carrier::Threads`] is used instead.
    Fibers,
    /// OS threads from a persistent pool, as many at once as the host has cores (more if
    /// the launch stops making progress): kernel code runs in parallel, but every wait at
    /// a barrier or collective is an OS context switch (microseconds).
    Threads,
}

impl Carrier {
    /// The carrier [`launch`] uses: [`Carrier::Fibers`], unless the environment variable
    /// `SPARSEKIT_EMU_CARRIER` is `threads` when it is first needed.
    pub fn default_for_launch() -> Self {
        static DEFAULT: OnceLock<Carrier> = OnceLock::new();
        *DEFAULT.get_or_init(|| match std::env::var("SPARSEKIT_EMU_CARRIER") {
            Ok(v) if v.eq_ignore_ascii_case("threads") => Carrier::Threads,
            _ => Carrier::Fibers,
        })
    }
}

/// Runs `kernel` as a grid of `cfg.grid` blocks of `cfg.block` threads on the host.
///
/// The closure is the body of every GPU thread; it calls a generic kernel with [`Emu`]
/// (see the [module documentation](self) for an example). Returns the first misuse found;
/// a kernel panic is reported as [`EmuError::KernelPanic`] (the default panic hook still
/// prints it to stderr). Uses [`Carrier::default_for_launch`].
pub fn launch(cfg: LaunchConfig, kernel: impl Fn() + Sync) -> Result<(), EmuError> {
    launch_with(Carrier::default_for_launch(), cfg, kernel)
}

/// The launch geometry of `params`' kernel.
fn kernel_config<P: KernelParams>(params: &P) -> LaunchConfig {
    let l = params.launch();
    LaunchConfig {
        grid: l.grid,
        block: l.block,
        dyn_smem_bytes: l.smem_bytes as usize,
    }
}

/// Runs the kernel that `params` belong to ([`KernelParams`]) with its own launch geometry
/// (`params.launch()`), as the GPU would: the emulator's typed launcher. Every global
/// access is checked against `buffers` (which should name `P::ENTRY`).
///
/// # Safety
/// The kernel's contract ([`KernelParams::run`]): every address in `params` is valid for
/// what the kernel reads and writes until this function returns, and nothing else
/// accesses the memory the kernel writes meanwhile. Accesses outside `buffers` are
/// reported before they happen, so `buffers` must describe live memory.
pub unsafe fn launch_kernel<P: KernelParams>(
    target: EmuTarget,
    params: P,
    buffers: &GlobalBuffers,
) -> Result<(), EmuError> {
    let cfg = kernel_config(&params);
    // SAFETY: the caller promises what `Params::new` requires (the GPU launch contract).
    let p = unsafe { Params::new(params) };
    let setup = LaunchSetup {
        global: GlobalCheck::new(buffers),
        tracer: None,
        blocks: None,
    };
    // SAFETY: the kernel's contract is the caller's; the geometry is the kernel's own.
    run_launch(Carrier::default_for_launch(), cfg, setup, || unsafe {
        run_as(target, p.get())
    })
}

/// Runs the kernel body on `target`'s [`Simt`] ([`Emu`] or [`EmuSm120a`]).
///
/// # Safety
/// The kernel's contract ([`KernelParams::run`]), inside a launch.
unsafe fn run_as<P: KernelParams>(target: EmuTarget, params: P) {
    // SAFETY: the caller's contract.
    unsafe {
        match target {
            EmuTarget::Generic => P::run::<Emu>(params),
            EmuTarget::Sm120a => P::run::<EmuSm120a>(params),
        }
    }
}

/// [`launch_kernel`] with access tracing (see [`Profile`]): runs the blocks `blocks` of
/// the kernel's grid (all when `None`; a sample keeps the real grid size, so grid-stride
/// loops and `grid_dim` see the launch the GPU would run) on fibers, checked against
/// `buffers`, and returns what the trace measured. Blocks not in the sample do not run,
/// so their outputs are not written.
///
/// # Safety
/// As [`launch_kernel`].
pub unsafe fn profile_kernel<P: KernelParams>(
    target: EmuTarget,
    params: P,
    buffers: &GlobalBuffers,
    blocks: Option<&[u32]>,
) -> Result<Profile, EmuError> {
    let cfg = kernel_config(&params);
    // SAFETY: as for `launch_kernel`.
    let p = unsafe { Params::new(params) };
    // SAFETY: as for `launch_kernel`.
    profile_launch(cfg, buffers, blocks, || unsafe { run_as(target, p.get()) })
}

/// [`launch`] with every global access checked against `buffers` (see
/// [`GlobalBuffers`]).
pub fn launch_checked(
    cfg: LaunchConfig,
    buffers: &GlobalBuffers,
    kernel: impl Fn() + Sync,
) -> Result<(), EmuError> {
    let setup = LaunchSetup {
        global: GlobalCheck::new(buffers),
        tracer: None,
        blocks: None,
    };
    run_launch(Carrier::default_for_launch(), cfg, setup, kernel)
}

/// [`launch_checked`] with access tracing, on fibers, over the blocks `blocks` (all when
/// `None`): see [`profile_kernel`].
pub fn profile_launch(
    cfg: LaunchConfig,
    buffers: &GlobalBuffers,
    blocks: Option<&[u32]>,
    kernel: impl Fn() + Sync,
) -> Result<Profile, EmuError> {
    let blocks = match blocks {
        None => None,
        Some(b) => {
            let mut b = b.to_vec();
            b.sort_unstable();
            b.dedup();
            if b.is_empty() || b.iter().any(|&x| x >= cfg.grid) {
                return Err(EmuError::InvalidConfig {
                    detail: format!(
                        "block sample {b:?} must be non-empty and below the grid of {}",
                        cfg.grid
                    ),
                });
            }
            Some(b)
        }
    };
    let setup = LaunchSetup {
        global: GlobalCheck::new(buffers),
        tracer: Some(Tracer::default()),
        blocks,
    };
    let mut tracer = None;
    let _traced = TracedLaunch::start();
    run_launch_then(Carrier::Fibers, cfg, setup, kernel, |sync| {
        tracer = sync
            .tracer
            .as_ref()
            .map(|t| t.profile(buffers.kernel(), cfg.grid, cfg.block, cfg.dyn_smem_bytes));
    })?;
    Ok(tracer.unwrap_or_default())
}

/// [`launch`] on the given [`Carrier`] (global accesses are checked for alignment only:
/// no buffers are registered; see [`launch_checked`]).
pub fn launch_with(
    carrier: Carrier,
    cfg: LaunchConfig,
    kernel: impl Fn() + Sync,
) -> Result<(), EmuError> {
    let setup = LaunchSetup {
        global: GlobalCheck::unregistered(),
        tracer: None,
        blocks: None,
    };
    run_launch(carrier, cfg, setup, kernel)
}

/// Runs a launch set up by `setup`.
fn run_launch(
    carrier: Carrier,
    cfg: LaunchConfig,
    setup: LaunchSetup,
    kernel: impl Fn() + Sync,
) -> Result<(), EmuError> {
    run_launch_then(carrier, cfg, setup, kernel, |_| {})
}

/// Runs a launch set up by `setup`, then hands its final state to `after` (on success).
fn run_launch_then(
    carrier: Carrier,
    cfg: LaunchConfig,
    setup: LaunchSetup,
    kernel: impl Fn() + Sync,
    after: impl FnOnce(&BlockSync),
) -> Result<(), EmuError> {
    cfg.validate()?;
    let fibers = carrier == Carrier::Fibers && fiber::SUPPORTED;
    let kernel: &(dyn Fn() + Sync) = &kernel;
    // SAFETY: `kernel` lives until this function returns or unwinds, and neither happens
    // while a worker may still call it:
    // - Threads: `supervise` returns only once the launch is over and `attached` is 0,
    //   and if anything here unwinds, `Abandon`'s drop fails the launch and waits for
    //   the same condition. A pool worker is counted in `attached` from the moment it is
    //   handed a GPU thread of this launch until after its last call of the kernel
    //   (`detach`, under the state lock, which orders that call before this function
    //   observes `attached == 0`).
    // - Fibers: every fiber runs only when `fiber::run` switches to it, on this thread;
    //   `run` returns (or unwinds) only between switches, and afterwards no fiber of
    //   this launch is ever resumed.
    let sync = Arc::new(BlockSync::new(
        cfg,
        unsafe { KernelRef::new(kernel) },
        fibers,
        setup,
    ));
    if fibers {
        fiber::run(&sync);
    } else {
        let abandon = Abandon(&sync);
        sync.start();
        sync.supervise();
        std::mem::forget(abandon);
    }
    sync.take_error().map_or(Ok(()), Err)?;
    after(&sync);
    Ok(())
}

/// Fails a launch whose driver unwinds, and waits until no worker can call its kernel.
struct Abandon<'a>(&'a Arc<BlockSync>);

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        self.0.abandon();
    }
}

/// Detaches a worker from its launch when it stops serving it, even by unwinding (which
/// the emulator's own code does not do; kernel panics are caught). `.1`: it stopped
/// normally.
struct Detach<'a>(&'a BlockSync, bool);

impl Drop for Detach<'_> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fail_internal("an emulator worker panicked");
        }
        self.0.detach();
    }
}

/// One emulated GPU thread's identity, in a thread-local while it runs a kernel.
pub(crate) struct Ctx {
    /// `threadIdx.x`.
    thread: u32,
    /// `blockIdx.x`.
    block: u32,
    /// `blockDim.x`.
    block_dim: u32,
    /// `gridDim.x`.
    grid_dim: u32,
    /// The launch's shared state.
    sync: Arc<BlockSync>,
    /// `atomic_add_u32` calls so far (fibers yield every [`YIELD_EVERY_ATOMICS`]).
    atomics: Cell<u32>,
    /// This thread's accesses, when the launch is traced.
    trace: Option<RefCell<ThreadTrace>>,
}

/// With fibers, a GPU thread lets the others run every this many atomics (so that a
/// thread spinning on an atomic cannot starve the thread it waits for).
const YIELD_EVERY_ATOMICS: u32 = 8;

thread_local! {
    /// The running GPU thread's [`Ctx`], set by [`run_item`] (and saved and restored
    /// around fiber switches).
    static CTX: RefCell<Option<Rc<Ctx>>> = const { RefCell::new(None) };
}

/// Takes the running GPU thread's context out of the thread-local (a fiber that parks).
pub(crate) fn take_ctx() -> Option<Rc<Ctx>> {
    CTX.with(|c| c.borrow_mut().take())
}

/// Puts a context taken with [`take_ctx`] back.
pub(crate) fn set_ctx(ctx: Option<Rc<Ctx>>) {
    CTX.with(|c| *c.borrow_mut() = ctx);
}

/// Calls `f` with the current emulated thread's context. `f` must not wait (park): use
/// [`ctx`] for that.
///
/// # Panics
/// When called outside [`launch`] (a `Simt` method of [`Emu`] used on a plain thread).
fn with_ctx<R>(f: impl FnOnce(&Ctx) -> R) -> R {
    CTX.with(|c| match &*c.borrow() {
        Some(ctx) => f(ctx),
        None => outside_launch(),
    })
}

/// The current emulated thread's context, for operations that may wait.
///
/// # Panics
/// As [`with_ctx`].
fn ctx() -> Rc<Ctx> {
    CTX.with(|c| c.borrow().clone())
        .unwrap_or_else(|| outside_launch())
}

/// Panics: a `Simt` method of [`Emu`] was used on a plain thread.
fn outside_launch() -> ! {
    panic!("sparsekit emu: a Simt method of Emu was called outside emu::launch")
}

/// Stops the calling GPU thread (the launch has failed). Unwinds with the [`Stop`]
/// payload, which the thread's driver catches; no panic hook runs.
fn stop() -> ! {
    panic::resume_unwind(Box::new(Stop))
}

/// The message of a panic payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(panic payload is not a string)".to_string()
    }
}

/// A pool worker serves `launch`, starting with GPU thread `thread` of block `block`,
/// until the launch has no more work for it; then it detaches.
pub(crate) fn serve(launch: &Arc<BlockSync>, me: &Arc<Worker>, block: u32, thread: u32) {
    let mut detach = Detach(launch, false);
    serve_items(launch, me, block, thread);
    detach.1 = true;
}

/// The loop of [`serve`].
fn serve_items(launch: &Arc<BlockSync>, me: &Arc<Worker>, block: u32, thread: u32) {
    let (mut block, mut thread) = (block, thread);
    loop {
        let returned = run_item(launch, me, block, thread);
        match launch.finish_item(thread, returned, me) {
            Next::Run(b, t) => (block, thread) = (b, t),
            Next::Idle => match me.wait(launch) {
                Job::Run {
                    block: b,
                    thread: t,
                    ..
                }
                | Job::Item {
                    block: b,
                    thread: t,
                } => (block, thread) = (b, t),
                Job::Leave => return,
            },
            Next::Leave => return,
        }
    }
}

/// Plays GPU thread `thread` of block `block` on the calling worker `me`; `true` when
/// it returned from the kernel, `false` when it panicked or was stopped.
fn run_item(launch: &Arc<BlockSync>, me: &Worker, block: u32, thread: u32) -> bool {
    launch.start_item(thread, me.waker());
    if launch.is_poisoned() {
        return false;
    }
    let ctx = Ctx {
        thread,
        block,
        block_dim: launch.block_dim,
        grid_dim: launch.grid_dim,
        sync: Arc::clone(launch),
        atomics: Cell::new(0),
        trace: launch.tracer.as_ref().map(|_| RefCell::default()),
    };
    let outer = CTX.with(|c| c.replace(Some(Rc::new(ctx))));
    let kernel = launch.kernel();
    // SAFETY: this worker is attached to the launch (it was handed this GPU thread and
    // detaches only when `serve` returns), so the kernel closure is alive.
    let result = panic::catch_unwind(AssertUnwindSafe(|| unsafe { kernel.call() }));
    let mine = CTX.with(|c| c.replace(outer));
    if let (Some(tracer), Some(ctx)) = (&launch.tracer, mine) {
        if let Some(trace) = &ctx.trace {
            tracer.hand_in(trace.take());
        }
    }
    match result {
        Ok(()) => true,
        Err(payload) => {
            if !payload.is::<Stop>() {
                let err = EmuError::KernelPanic {
                    block,
                    thread,
                    message: panic_message(&*payload),
                };
                launch.fail_unlocked(err);
            }
            false
        }
    }
}

/// Converts the internal stop signal into an unwind.
fn or_stop<T>(r: Result<T, Stop>) -> T {
    match r {
        Ok(v) => v,
        Err(Stop) => stop(),
    }
}

/// The current thread's position for shared memory checks.
fn accessor(ctx: &Ctx) -> Accessor {
    Accessor {
        block: ctx.block,
        thread: ctx.thread,
        epoch: ctx.sync.epoch.load(Ordering::Acquire),
    }
}

/// Checks (and, when the launch is traced, records) a global access of the running
/// thread; stops it when the access fails a check.
fn global_access(loc: &'static Location<'static>, op: GlobalOp, addr: usize, size: usize) {
    with_ctx(|c| {
        if c.sync.is_poisoned() {
            stop();
        }
        if let Err(f) = c.sync.global.access(op, addr, size) {
            let err = c.sync.global.error(f, (c.block, c.thread), op, addr, size);
            c.sync.fail_unlocked(err);
            stop();
        }
        if let Some(t) = &c.trace {
            let at = c.sync.global.model_addr(addr);
            t.borrow_mut()
                .record(loc, c.thread, Space::Global, op, at, size);
        }
    });
}

/// Records a shared-memory access of the running thread when the launch is traced.
fn trace_shared(
    c: &Ctx,
    loc: &'static Location<'static>,
    op: GlobalOp,
    offset: usize,
    size: usize,
) {
    if let Some(t) = &c.trace {
        t.borrow_mut()
            .record(loc, c.thread, Space::Shared, op, offset as u64, size);
    }
}

/// Traced launches running in the process (lets untraced launches skip the unroll
/// bookkeeping cheaply).
static TRACED_LAUNCHES: AtomicU32 = AtomicU32::new(0);

/// Counts a traced launch while it runs.
struct TracedLaunch;

impl TracedLaunch {
    fn start() -> Self {
        TRACED_LAUNCHES.fetch_add(1, Ordering::Relaxed);
        TracedLaunch
    }
}

impl Drop for TracedLaunch {
    fn drop(&mut self) {
        TRACED_LAUNCHES.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Tells the running thread's trace (if traced) that it executed a warp collective or a
/// barrier.
fn trace_sync(c: &Ctx) {
    if let Some(t) = &c.trace {
        t.borrow_mut().sync();
    }
}

/// Enters iteration `i` of a kernel's forced unroll (`unroll!`): the accesses inside are
/// told apart from the other iterations' in a traced launch. No-op elsewhere.
pub(crate) fn unroll_enter(i: u32) {
    if TRACED_LAUNCHES.load(Ordering::Relaxed) == 0 {
        return;
    }
    CTX.with(|c| {
        if let Some(ctx) = c.borrow().as_ref() {
            if let Some(t) = &ctx.trace {
                t.borrow_mut().unroll_enter(i);
            }
        }
    });
}

/// Leaves the innermost forced unroll iteration (see [`unroll_enter`]).
pub(crate) fn unroll_exit() {
    if TRACED_LAUNCHES.load(Ordering::Relaxed) == 0 {
        return;
    }
    CTX.with(|c| {
        if let Some(ctx) = c.borrow().as_ref() {
            if let Some(t) = &ctx.trace {
                t.borrow_mut().unroll_exit();
            }
        }
    });
}

/// Runs a shuffle or ballot.
fn word_collective(kind: Kind, mask: u32, word: u32, param: u32) -> u32 {
    let input = Input {
        word,
        param,
        ..Input::default()
    };
    let c = ctx();
    let out = or_stop(c.sync.collective(c.thread, kind, mask, input)).word;
    trace_sync(&c);
    out
}

/// Runs an MMA.
fn mma_collective(kind: Kind, a: [u32; 4], b: [u32; 2], c: [f32; 4], scale: [u32; 2]) -> [f32; 4] {
    let input = Input {
        frags: MmaFragments { a, b, c, scale },
        ..Input::default()
    };
    let c = ctx();
    let out = or_stop(c.sync.collective(c.thread, kind, u32::MAX, input)).d;
    trace_sync(&c);
    out
}

/// The GPU the emulator stands in for: which arch-specific instructions the kernels may
/// take ([`Simt::HAS_MXF8_MMA`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum EmuTarget {
    /// What every arch of the PTX runs (bf16 and e4m3 `mma.sync`; the PTX for sm_80,
    /// sm_90 and sm_120).
    #[default]
    Generic,
    /// sm_120a (RTX 50 series, RTX PRO Blackwell): also the block-scaled MXFP8 mma.
    Sm120a,
}

impl EmuTarget {
    /// `generic`, `sm_120a`.
    pub fn name(self) -> &'static str {
        match self {
            EmuTarget::Generic => "generic",
            EmuTarget::Sm120a => "sm_120a",
        }
    }
}

/// The emulator's [`Simt`] implementations (use them only inside [`launch`]):
/// `MXF8` says whether the block-scaled mma exists ([`EmuTarget::Sm120a`]).
///
/// # Panics
/// Every method panics when called outside [`launch`].
#[derive(Debug, Clone, Copy)]
pub struct EmuArch<const MXF8: bool>;

/// The emulator as every arch of the PTX ([`EmuTarget::Generic`]).
pub type Emu = EmuArch<false>;
/// The emulator as sm_120a ([`EmuTarget::Sm120a`]).
pub type EmuSm120a = EmuArch<true>;

impl<const MXF8: bool> Simt for EmuArch<MXF8> {
    const HAS_FP8_MMA: bool = true;
    const HAS_MXF8_MMA: bool = MXF8;

    fn thread_idx() -> u32 {
        with_ctx(|c| c.thread)
    }

    fn block_idx() -> u32 {
        with_ctx(|c| c.block)
    }

    fn block_dim() -> u32 {
        with_ctx(|c| c.block_dim)
    }

    fn grid_dim() -> u32 {
        with_ctx(|c| c.grid_dim)
    }

    fn sync_threads() {
        let c = ctx();
        or_stop(c.sync.sync_threads(c.thread));
        trace_sync(&c);
    }

    #[track_caller]
    unsafe fn smem_load<T: Copy>(byte_offset: usize) -> T {
        let loc = Location::caller();
        let mut value = MaybeUninit::<T>::uninit();
        // SAFETY: the slice covers exactly the bytes of `value`; `MaybeUninit<u8>` has no
        // validity requirement, so viewing uninitialised bytes this way is sound.
        let out = unsafe {
            std::slice::from_raw_parts_mut(
                value.as_mut_ptr().cast::<MaybeUninit<u8>>(),
                size_of::<T>(),
            )
        };
        with_ctx(|c| {
            if c.sync.is_poisoned() {
                stop();
            }
            let who = accessor(c);
            let result = c
                .sync
                .lock_smem()
                .load(who, byte_offset, std::mem::align_of::<T>(), out);
            if let Err(err) = result {
                c.sync.fail_unlocked(err);
                stop();
            }
            trace_shared(c, loc, GlobalOp::Load, byte_offset, size_of::<T>());
        });
        // SAFETY: every byte of `value` was copied from shared memory; the caller promises
        // that they were written as a valid `T`.
        unsafe { value.assume_init() }
    }

    #[track_caller]
    unsafe fn smem_store<T: Copy>(byte_offset: usize, value: T) {
        let loc = Location::caller();
        let value = MaybeUninit::new(value);
        // SAFETY: the slice covers exactly the bytes of `value` (padding included, hence
        // `MaybeUninit<u8>`), which lives until the end of this function.
        let data = unsafe {
            std::slice::from_raw_parts(value.as_ptr().cast::<MaybeUninit<u8>>(), size_of::<T>())
        };
        with_ctx(|c| {
            if c.sync.is_poisoned() {
                stop();
            }
            let who = accessor(c);
            let result =
                c.sync
                    .lock_smem()
                    .store(who, byte_offset, std::mem::align_of::<T>(), data);
            if let Err(err) = result {
                c.sync.fail_unlocked(err);
                stop();
            }
            trace_shared(c, loc, GlobalOp::Store, byte_offset, size_of::<T>());
        });
    }

    #[track_caller]
    unsafe fn smem_atomic_add_u32(byte_offset: usize, value: u32) -> u32 {
        let loc = Location::caller();
        with_ctx(|c| {
            if c.sync.is_poisoned() {
                stop();
            }
            let who = accessor(c);
            let result = c.sync.lock_smem().atomic_add_u32(who, byte_offset, value);
            match result {
                Ok(old) => {
                    trace_shared(c, loc, GlobalOp::Atomic, byte_offset, 4);
                    old
                }
                Err(err) => {
                    c.sync.fail_unlocked(err);
                    stop()
                }
            }
        })
    }

    fn shfl_xor(mask: u32, value: u32, lane_mask: u32) -> u32 {
        word_collective(Kind::ShflXor, mask, value, lane_mask)
    }

    fn shfl_idx(mask: u32, value: u32, src_lane: u32) -> u32 {
        word_collective(Kind::ShflIdx, mask, value, src_lane)
    }

    fn shfl_down(mask: u32, value: u32, delta: u32) -> u32 {
        word_collective(Kind::ShflDown, mask, value, delta)
    }

    fn ballot(mask: u32, predicate: bool) -> u32 {
        word_collective(Kind::Ballot, mask, u32::from(predicate), 0)
    }

    #[track_caller]
    unsafe fn gld<T: Word>(ptr: GlobalPtr<T>) -> T {
        global_access(
            Location::caller(),
            GlobalOp::Load,
            ptr.addr(),
            size_of::<T>(),
        );
        // SAFETY: checked against the launch's buffers (in bounds and aligned when the
        // launcher registered them; aligned always); the caller guarantees the rest.
        unsafe { ptr.raw().read() }
    }

    #[track_caller]
    unsafe fn gst<T: Word>(ptr: GlobalMut<T>, value: T) {
        global_access(
            Location::caller(),
            GlobalOp::Store,
            ptr.addr(),
            size_of::<T>(),
        );
        // SAFETY: as for `gld`; the caller guarantees that this thread owns the bytes.
        unsafe { ptr.raw().write(value) }
    }

    fn threadfence() {
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    #[track_caller]
    unsafe fn atomic_add_u32(ptr: GlobalMut<u32>, value: u32) -> u32 {
        let in_launch = CTX.with(|c| c.borrow().is_some());
        if in_launch {
            global_access(Location::caller(), GlobalOp::Atomic, ptr.addr(), 4);
        }
        // SAFETY: the caller guarantees `ptr` is valid and aligned (checked against the
        // launch's buffers inside a launch); every emulated access to it that may overlap
        // goes through atomics (as on the GPU).
        let atomic = unsafe { AtomicU32::from_ptr(ptr.raw()) };
        let old = atomic.fetch_add(value, Ordering::SeqCst);
        // (Works outside a launch too, as it always has: only yielding needs a context.)
        let Some(c) = CTX.with(|c| c.borrow().clone()) else {
            return old;
        };
        if c.sync.on_fibers() {
            let n = c.atomics.get().wrapping_add(1);
            c.atomics.set(n);
            if n % YIELD_EVERY_ATOMICS == 0 {
                or_stop(c.sync.yield_now(c.thread));
            }
        }
        old
    }

    fn mma_bf16_m16n8k16(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        mma_collective(Kind::MmaBf16, a, b, c, [0; 2])
    }

    fn mma_e4m3_m16n8k32(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        mma_collective(Kind::MmaE4m3, a, b, c, [0; 2])
    }

    fn mma_mxf8_e4m3_m16n8k32(
        a: [u32; 4],
        b: [u32; 2],
        c: [f32; 4],
        sfa: u32,
        sfb: u32,
    ) -> [f32; 4] {
        assert!(MXF8, "the block-scaled mma exists only on sm_120a");
        mma_collective(Kind::MmaMxf8, a, b, c, [sfa, sfb])
    }
}
