//! Fibers: the workers of a [`Carrier::Fibers`](super::Carrier::Fibers) launch.
//!
//! A fiber is a stack of its own plus a saved stack pointer; switching between fibers
//! saves the callee-saved registers on the current stack and loads another stack pointer,
//! which costs a few nanoseconds instead of the microseconds of an OS context switch.
//! Every worker of such a launch (see [`super::block`] and [`super::pool`]: a fiber plays
//! the same role as a pool thread) is a fiber, and all of them run, one at a time, on the
//! thread that called `launch`, driven by [`run`]: parking a worker switches back to
//! `run`, and waking it queues it to be switched to. Fibers never move to another OS
//! thread, so thread-locals stay consistent; the emulator's own thread-local (the
//! current GPU thread's context) is saved and restored around each switch.
//!
//! Stacks are anonymous mappings of [`STACK_BYTES`] with a [`GUARD_BYTES`] inaccessible
//! guard below (a stack overflow faults instead of corrupting memory), reused across
//! launches through a cache. A fiber's first frame has a null return address, so
//! backtraces stop there; kernel panics never unwind past it (each GPU thread runs
//! inside `catch_unwind`, and so does the fiber's body).
//!
//! Only x86-64 Linux has fibers ([`SUPPORTED`]); elsewhere launches use pool threads.

/// Whether this platform has fibers.
pub(crate) const SUPPORTED: bool = cfg!(all(target_arch = "x86_64", target_os = "linux"));

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) use imp::{park, run, spawn, unpark};

/// Stand-ins where fibers do not exist (never called: [`SUPPORTED`] is false).
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod stub {
    use super::super::block::BlockSync;
    use super::super::pool::Job;
    use std::sync::Arc;

    pub(crate) fn park() {
        std::thread::park();
    }

    pub(crate) fn unpark(_id: u32) {}

    pub(crate) fn spawn(_job: Job) -> Result<(), String> {
        Err("fibers are not supported on this platform".to_string())
    }

    pub(crate) fn run(sync: &Arc<BlockSync>) {
        sync.start();
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
pub(crate) use stub::{park, run, spawn, unpark};

/// Usable bytes of a fiber stack (address space only: pages are committed when touched).
pub(crate) const STACK_BYTES: usize = 1 << 20;
/// Inaccessible bytes below each fiber stack.
pub(crate) const GUARD_BYTES: usize = 64 << 10;

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod imp {
    use std::arch::asm;
    use std::cell::{Cell, RefCell};
    use std::collections::VecDeque;
    use std::ffi::{c_int, c_long, c_void};
    use std::panic::{self, AssertUnwindSafe};
    use std::ptr;
    use std::rc::Rc;
    use std::sync::{Arc, Mutex};

    use super::super::block::BlockSync;
    use super::super::pool::{lock, Job, Waker, Worker};
    use super::{GUARD_BYTES, STACK_BYTES};

    extern "C" {
        fn mmap(
            addr: *mut c_void,
            len: usize,
            prot: c_int,
            flags: c_int,
            fd: c_int,
            offset: c_long,
        ) -> *mut c_void;
        fn munmap(addr: *mut c_void, len: usize) -> c_int;
        fn mprotect(addr: *mut c_void, len: usize, prot: c_int) -> c_int;
    }

    const PROT_NONE: c_int = 0;
    const PROT_READ: c_int = 1;
    const PROT_WRITE: c_int = 2;
    const MAP_PRIVATE: c_int = 0x02;
    const MAP_ANONYMOUS: c_int = 0x20;
    const MAP_NORESERVE: c_int = 0x4000;
    const MAP_STACK: c_int = 0x2_0000;

    /// Bytes of one stack mapping.
    const MAPPING_BYTES: usize = GUARD_BYTES + STACK_BYTES;
    /// Most stacks kept for reuse.
    const CACHE_MAX: usize = 1100;

    /// A fiber stack: an anonymous mapping whose lowest [`GUARD_BYTES`] are inaccessible.
    #[derive(Debug)]
    struct Stack {
        /// Address of the mapping.
        base: usize,
    }

    impl Stack {
        /// Maps a new stack.
        fn new() -> Result<Self, String> {
            // SAFETY: a fresh private anonymous mapping at an address of the kernel's
            // choosing affects no existing memory.
            let p = unsafe {
                mmap(
                    ptr::null_mut(),
                    MAPPING_BYTES,
                    PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK,
                    -1,
                    0,
                )
            };
            if p as isize == -1 || p.is_null() {
                return Err(format!(
                    "could not map a fiber stack: {}",
                    std::io::Error::last_os_error()
                ));
            }
            let stack = Self { base: p as usize };
            // SAFETY: the first GUARD_BYTES of the mapping just created, which nothing
            // uses yet.
            if unsafe { mprotect(p, GUARD_BYTES, PROT_NONE) } != 0 {
                return Err(format!(
                    "could not protect a fiber stack's guard: {}",
                    std::io::Error::last_os_error()
                ));
            }
            Ok(stack)
        }

        /// The highest address of the stack (16-byte aligned: mappings are page aligned).
        fn top(&self) -> usize {
            self.base + MAPPING_BYTES
        }
    }

    impl Drop for Stack {
        fn drop(&mut self) {
            // SAFETY: the mapping is this value's; no fiber that could still run uses it
            // (a fiber's stack is dropped only once it is done, or when its launch is
            // abandoned and it will never be resumed).
            unsafe { munmap(self.base as *mut c_void, MAPPING_BYTES) };
        }
    }

    /// Stacks of finished fibers, for reuse.
    static CACHE: Mutex<Vec<Stack>> = Mutex::new(Vec::new());

    /// A stack from the cache, or a new one.
    fn take_stack() -> Result<Stack, String> {
        match lock(&CACHE).pop() {
            Some(stack) => Ok(stack),
            None => Stack::new(),
        }
    }

    /// Returns a stack to the cache (or unmaps it when the cache is full).
    fn recycle(stack: Stack) {
        let mut cache = lock(&CACHE);
        if cache.len() < CACHE_MAX {
            cache.push(stack);
        }
    }

    /// Saves the current context and resumes the one whose stack pointer is `to`.
    ///
    /// The callee-saved registers that inline assembly may not name (`rbx`, `rbp`) and a
    /// resume address are pushed on the current stack, whose pointer is stored at
    /// `*from`; then the stack pointer becomes `to` and the resume address found there is
    /// popped and jumped to. All other registers are declared clobbered, so the compiler
    /// saves whatever it needs around this call. When something later switches back to
    /// `*from`, execution continues after the `2:` label, which restores `rbx` and `rbp`.
    ///
    /// # Safety
    /// `from` must be valid for a write. `to` must be a stack pointer stored by this
    /// function (a suspended context that has not been resumed since) or prepared by
    /// [`initial_sp`], on a stack that is still mapped.
    #[inline(never)]
    unsafe fn switch(from: *mut usize, to: usize) {
        // SAFETY: the caller's contract; see the function documentation for the protocol.
        unsafe {
            asm!(
                "push rbp",
                "push rbx",
                "lea rax, [rip + 2f]",
                "push rax",
                "mov [rdi], rsp",
                "mov rsp, rsi",
                "ret",
                "2:",
                "pop rbx",
                "pop rbp",
                in("rdi") from,
                in("rsi") to,
                out("r12") _,
                out("r13") _,
                out("r14") _,
                out("r15") _,
                clobber_abi("C"),
            );
        }
    }

    /// The stack pointer that starts a fiber on `stack`: switching to it "returns" into
    /// [`fiber_entry`] with a null return address and the stack aligned as after a call.
    fn initial_sp(stack: &Stack) -> usize {
        let top = stack.top();
        let sp = top - 16;
        let entry: extern "C" fn() -> ! = fiber_entry;
        // SAFETY: `top - 16 .. top` lies in the writable part of the mapping, and is
        // 8-byte aligned; nothing else uses this stack yet.
        unsafe {
            (sp as *mut usize).write(entry as usize);
            ((sp + 8) as *mut usize).write(0);
        }
        sp
    }

    /// A fiber's scheduling state.
    #[derive(Debug, Default)]
    struct FiberState {
        /// Its first job (taken when it starts).
        start: Option<Job>,
        /// Waiting in [`park`] to be woken.
        parked: bool,
        /// Woken while not parked: the next [`park`] returns at once.
        token: bool,
        /// Its body has returned; it must not be resumed.
        done: bool,
    }

    /// One fiber.
    #[derive(Debug)]
    struct Fiber {
        /// Saved stack pointer while it is not running.
        sp: Cell<usize>,
        /// Its stack (taken back when it is done).
        stack: RefCell<Option<Stack>>,
        /// Scheduling state.
        state: RefCell<FiberState>,
    }

    /// The fibers of one launch and their run queue, on the launching thread.
    #[derive(Debug, Default)]
    struct Runner {
        /// The scheduler's saved stack pointer while a fiber runs.
        sched_sp: Cell<usize>,
        /// Every fiber of the launch, by index.
        fibers: RefCell<Vec<Rc<Fiber>>>,
        /// Fibers to resume, in order.
        runq: RefCell<VecDeque<u32>>,
        /// The fiber running now.
        current: Cell<u32>,
    }

    thread_local! {
        /// The runner of the launch whose fibers run on this thread, while [`run`] runs.
        static RUNNER: Cell<*const Runner> = const { Cell::new(ptr::null()) };
    }

    /// Calls `f` with this thread's runner, if a fiber launch is running on it.
    fn with_runner<R>(f: impl FnOnce(&Runner) -> R) -> Option<R> {
        let p = RUNNER.with(Cell::get);
        if p.is_null() {
            return None;
        }
        // SAFETY: `run` sets RUNNER to its own `Runner`, which lives on its frame, and
        // restores the previous value before that frame ends; fibers and wakers using it
        // run only inside `run` (between its switches), on this thread.
        Some(f(unsafe { &*p }))
    }

    /// The running fiber.
    fn current(rt: &Runner) -> Option<Rc<Fiber>> {
        rt.fibers.borrow().get(rt.current.get() as usize).cloned()
    }

    /// Parks the running fiber until [`unpark`] (returns at once if it was unparked since
    /// its last park). Outside a fiber, parks the OS thread.
    pub(crate) fn park() {
        let parked = with_runner(|rt| {
            let fiber = current(rt)?;
            {
                let mut state = fiber.state.borrow_mut();
                if state.token {
                    state.token = false;
                    return Some(());
                }
                state.parked = true;
            }
            let ctx = super::super::take_ctx();
            let from = fiber.sp.as_ptr();
            let to = rt.sched_sp.get();
            drop(fiber);
            // SAFETY: `from` is this fiber's saved-pointer cell, kept alive by the
            // runner's list; `to` is the scheduler context saved by `run` when it
            // switched to this fiber, on the launching thread's own stack.
            unsafe { switch(from, to) };
            super::super::set_ctx(ctx);
            Some(())
        });
        if parked.flatten().is_none() {
            std::thread::park();
        }
    }

    /// Wakes fiber `id` of the running launch.
    pub(crate) fn unpark(id: u32) {
        with_runner(|rt| {
            let Some(fiber) = rt.fibers.borrow().get(id as usize).cloned() else {
                return;
            };
            let mut state = fiber.state.borrow_mut();
            if state.parked {
                state.parked = false;
                rt.runq.borrow_mut().push_back(id);
            } else if !state.done {
                state.token = true;
            }
        });
    }

    /// Starts a new fiber of the running launch with `job`.
    pub(crate) fn spawn(job: Job) -> Result<(), String> {
        let stack = take_stack()?;
        let added = with_runner(move |rt| {
            let mut fibers = rt.fibers.borrow_mut();
            let id = u32::try_from(fibers.len()).map_err(|_| "too many fibers".to_string())?;
            let sp = initial_sp(&stack);
            fibers.push(Rc::new(Fiber {
                sp: Cell::new(sp),
                stack: RefCell::new(Some(stack)),
                state: RefCell::new(FiberState {
                    start: Some(job),
                    ..FiberState::default()
                }),
            }));
            rt.runq.borrow_mut().push_back(id);
            Ok(())
        });
        added.unwrap_or_else(|| Err("no fiber launch runs on this thread".to_string()))
    }

    /// First frame of every fiber (entered by a switch, never called).
    extern "C" fn fiber_entry() -> ! {
        fiber_body();
        // Done: tell the scheduler, which will never resume this fiber.
        let next = with_runner(|rt| {
            let fiber = current(rt)?;
            fiber.state.borrow_mut().done = true;
            let from = fiber.sp.as_ptr();
            drop(fiber);
            Some((from, rt.sched_sp.get()))
        });
        if let Some(Some((from, to))) = next {
            // SAFETY: as in `park`: this fiber's cell, and the scheduler's context. The
            // frames left on this stack own nothing (`fiber_body` has returned).
            unsafe { switch(from, to) };
        }
        // Unreachable: a done fiber is never resumed, and fibers only start inside `run`.
        std::process::abort()
    }

    /// A fiber's work: serve its launch, starting with its first job.
    #[inline(never)]
    fn fiber_body() {
        let start = with_runner(|rt| {
            let fiber = current(rt)?;
            let job = fiber.state.borrow_mut().start.take();
            Some((rt.current.get(), job))
        });
        let Some(Some((
            id,
            Some(Job::Run {
                launch,
                block,
                thread,
            }),
        ))) = start
        else {
            return;
        };
        let me = Arc::new(Worker::new(Waker::Fiber(id)));
        // `serve` catches kernel panics; this only guards against the emulator's own.
        let _ = panic::catch_unwind(AssertUnwindSafe(|| {
            super::super::serve(&launch, &me, block, thread);
        }));
    }

    /// Runs `sync`'s launch to the end: starts it, then switches to runnable fibers until
    /// none is left.
    pub(crate) fn run(sync: &Arc<BlockSync>) {
        let rt = Runner::default();
        // Restores the thread-locals when `run` ends, even by unwinding (so that RUNNER
        // never points to a dead runner). Declared after `rt`, so it drops first.
        let _restore = Restore {
            runner: RUNNER.with(|r| r.replace(&rt)),
            ctx: Some(super::super::take_ctx()),
        };
        sync.start();
        let mut reported = false;
        loop {
            let next = rt.runq.borrow_mut().pop_front();
            let Some(id) = next else {
                if sync.finished() || reported {
                    break;
                }
                // Every fiber waits but the launch is not over: report, which wakes them.
                sync.fail_internal("every GPU thread waits, but no deadlock was detected");
                reported = true;
                continue;
            };
            let Some(fiber) = rt.fibers.borrow().get(id as usize).cloned() else {
                continue;
            };
            rt.current.set(id);
            let to = fiber.sp.get();
            // SAFETY: `to` was saved by the fiber when it parked (or prepared by
            // `initial_sp`) and the fiber has not run since: a fiber is queued only
            // when parked, once per park, and never once done. Its stack is mapped.
            unsafe { switch(rt.sched_sp.as_ptr(), to) };
            let done = fiber.state.borrow().done;
            if done {
                if let Some(stack) = fiber.stack.borrow_mut().take() {
                    recycle(stack);
                }
            }
        }
        // Fibers still suspended here (only after an internal error) are never resumed;
        // their stacks are unmapped with `rt` without running anything on them.
    }

    /// What [`run`] found in the thread-locals, put back when it ends.
    struct Restore {
        /// The enclosing launch's runner (null outside fiber launches).
        runner: *const Runner,
        /// The enclosing GPU thread's context (a launch inside a kernel).
        ctx: Option<Option<Rc<super::super::Ctx>>>,
    }

    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(ctx) = self.ctx.take() {
                super::super::set_ctx(ctx);
            }
            RUNNER.with(|r| r.set(self.runner));
        }
    }
}
