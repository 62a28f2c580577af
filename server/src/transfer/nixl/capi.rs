//! NIXL's C API (`libnixl_capi.so`, shipped in the `nixl-cu12` wheel), loaded at run time.
//!
//! The transport needs nothing of NIXL to build: no headers, no libclang, no link-time
//! library. The library is opened on first use ([`api`]), from the first of
//! `$SPARSEKIT_NIXL_LIB/libnixl_capi.so`, `.tools/nixl/.nixl_cu12.mesonpy.libs/` (what
//! `scripts/setup-nixl.sh` installs) under the working directory or above the running
//! binary, and the dynamic loader's own search (`LD_LIBRARY_PATH`, system paths). The
//! wheel's libraries carry `$ORIGIN` rpaths, so opening it by path needs no
//! `LD_LIBRARY_PATH`. Without it every entry point returns a typed error; nothing aborts.
//!
//! Only the calls the transport makes are declared, each with the C signature of NIXL
//! 1.5's `wrapper.h` (status codes `i32`, enums `i32`, opaque handles as pointers to
//! uninhabited structs). The wrappers below own their handles and free them on drop. An
//! [`Agent`] is not thread-safe (NIXL's `thread_sync` is off): its methods take
//! `&mut self`, so the owner must serialise them (the transport keeps it in a mutex).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::ptr;
use std::sync::OnceLock;

use libloading::Library;

/// A NIXL C API status code (`nixl_capi_status_t`).
type Status = c_int;
const SUCCESS: Status = 0;
const IN_PROGRESS: Status = 1;
/// `NIXL_CAPI_MEM_DRAM`.
const MEM_DRAM: c_int = 0;
/// `NIXL_CAPI_XFER_OP_WRITE`.
const OP_WRITE: c_int = 1;

/// The name the dynamic loader knows the library by.
pub const LIBRARY: &str = "libnixl_capi.so";

macro_rules! opaque {
    ($($name:ident),*) => {$(
        #[repr(C)]
        pub(super) struct $name {
            _private: [u8; 0],
        }
    )*};
}
opaque!(
    RawAgent,
    RawBackend,
    RawParams,
    RawMemList,
    RawOptArgs,
    RawXferDlist,
    RawRegDlist,
    RawXferReq,
    RawNotifMap
);

/// `nixl_capi_agent_config_t`.
#[repr(C)]
struct AgentConfig {
    enable_prog_thread: bool,
    enable_listen_thread: bool,
    listen_port: c_int,
    thread_sync: c_int,
    num_workers: u32,
    pthr_delay_us: u64,
    lthr_delay_us: u64,
    capture_telemetry: bool,
}

/// Declares the entry points: one field per C function, resolved by its symbol name.
macro_rules! entry_points {
    ($($field:ident = $sym:literal : fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The resolved entry points of `libnixl_capi.so` (and the library, kept open).
        pub struct Api {
            $($field: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
            _lib: Library,
            /// Where the library was opened from.
            pub origin: String,
        }

        impl Api {
            fn resolve(lib: Library, origin: String) -> Result<Api, String> {
                Ok(Api {
                    // SAFETY: each symbol is declared with the C signature of NIXL 1.5's
                    // C API (`wrapper.h`); the pointer is copied out and stays valid while
                    // `_lib` (moved into the same struct, never unloaded before it) lives.
                    $($field: unsafe {
                        *lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(
                            concat!($sym, "\0").as_bytes(),
                        )
                        .map_err(|e| format!("{origin}: symbol {}: {e}", $sym))?
                    },)*
                    _lib: lib,
                    origin,
                })
            }
        }
    };
}

entry_points! {
    is_stub = "nixl_capi_is_stub": fn() -> bool;
    create_configured_agent = "nixl_capi_create_configured_agent":
        fn(*const c_char, *const AgentConfig, *mut *mut RawAgent) -> Status;
    destroy_agent = "nixl_capi_destroy_agent": fn(*mut RawAgent) -> Status;
    get_local_md = "nixl_capi_get_local_md":
        fn(*mut RawAgent, *mut *mut c_void, *mut usize) -> Status;
    load_remote_md = "nixl_capi_load_remote_md":
        fn(*mut RawAgent, *const c_void, usize, *mut *mut c_char) -> Status;
    invalidate_remote_md = "nixl_capi_invalidate_remote_md":
        fn(*mut RawAgent, *const c_char) -> Status;
    get_plugin_params = "nixl_capi_get_plugin_params":
        fn(*mut RawAgent, *const c_char, *mut *mut RawMemList, *mut *mut RawParams) -> Status;
    destroy_mem_list = "nixl_capi_destroy_mem_list": fn(*mut RawMemList) -> Status;
    destroy_params = "nixl_capi_destroy_params": fn(*mut RawParams) -> Status;
    params_add = "nixl_capi_params_add":
        fn(*mut RawParams, *const c_char, *const c_char) -> Status;
    create_backend = "nixl_capi_create_backend":
        fn(*mut RawAgent, *const c_char, *mut RawParams, *mut *mut RawBackend) -> Status;
    destroy_backend = "nixl_capi_destroy_backend": fn(*mut RawBackend) -> Status;
    create_opt_args = "nixl_capi_create_opt_args": fn(*mut *mut RawOptArgs) -> Status;
    destroy_opt_args = "nixl_capi_destroy_opt_args": fn(*mut RawOptArgs) -> Status;
    opt_args_add_backend = "nixl_capi_opt_args_add_backend":
        fn(*mut RawOptArgs, *mut RawBackend) -> Status;
    opt_args_set_notif_msg = "nixl_capi_opt_args_set_notif_msg":
        fn(*mut RawOptArgs, *const c_void, usize) -> Status;
    opt_args_set_has_notif = "nixl_capi_opt_args_set_has_notif":
        fn(*mut RawOptArgs, bool) -> Status;
    create_reg_dlist = "nixl_capi_create_reg_dlist": fn(c_int, *mut *mut RawRegDlist) -> Status;
    destroy_reg_dlist = "nixl_capi_destroy_reg_dlist": fn(*mut RawRegDlist) -> Status;
    reg_dlist_add_desc = "nixl_capi_reg_dlist_add_desc":
        fn(*mut RawRegDlist, usize, usize, u64, *const c_void, usize) -> Status;
    register_mem = "nixl_capi_register_mem":
        fn(*mut RawAgent, *mut RawRegDlist, *mut RawOptArgs) -> Status;
    deregister_mem = "nixl_capi_deregister_mem":
        fn(*mut RawAgent, *mut RawRegDlist, *mut RawOptArgs) -> Status;
    create_xfer_dlist = "nixl_capi_create_xfer_dlist":
        fn(c_int, *mut *mut RawXferDlist) -> Status;
    destroy_xfer_dlist = "nixl_capi_destroy_xfer_dlist": fn(*mut RawXferDlist) -> Status;
    xfer_dlist_add_desc = "nixl_capi_xfer_dlist_add_desc":
        fn(*mut RawXferDlist, usize, usize, u64) -> Status;
    create_xfer_req = "nixl_capi_create_xfer_req":
        fn(*mut RawAgent, c_int, *mut RawXferDlist, *mut RawXferDlist, *const c_char,
           *mut *mut RawXferReq, *mut RawOptArgs) -> Status;
    post_xfer_req = "nixl_capi_post_xfer_req":
        fn(*mut RawAgent, *mut RawXferReq, *mut RawOptArgs) -> Status;
    get_xfer_status = "nixl_capi_get_xfer_status": fn(*mut RawAgent, *mut RawXferReq) -> Status;
    release_xfer_req = "nixl_capi_release_xfer_req": fn(*mut RawAgent, *mut RawXferReq) -> Status;
    destroy_xfer_req = "nixl_capi_destroy_xfer_req": fn(*mut RawXferReq) -> Status;
    gen_notif = "nixl_capi_gen_notif":
        fn(*mut RawAgent, *const c_char, *const c_void, usize, *mut RawOptArgs) -> Status;
    create_notif_map = "nixl_capi_create_notif_map": fn(*mut *mut RawNotifMap) -> Status;
    destroy_notif_map = "nixl_capi_destroy_notif_map": fn(*mut RawNotifMap) -> Status;
    get_notifs = "nixl_capi_get_notifs":
        fn(*mut RawAgent, *mut RawNotifMap, *mut RawOptArgs) -> Status;
    notif_map_get_notifs_size = "nixl_capi_notif_map_get_notifs_size":
        fn(*mut RawNotifMap, *const c_char, *mut usize) -> Status;
    notif_map_get_notif = "nixl_capi_notif_map_get_notif":
        fn(*mut RawNotifMap, *const c_char, usize, *mut *const c_void, *mut usize) -> Status;
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("nixl::Api")
            .field("origin", &self.origin)
            .finish()
    }
}

/// Where to look for the library, in order (see the module docs).
fn candidates() -> Vec<PathBuf> {
    let exe = std::env::current_exe().ok();
    let mut v: Vec<PathBuf> = crate::transfer::nixl_runtime_dir(exe.as_deref())
        .map(|d| d.join(LIBRARY))
        .into_iter()
        .collect();
    v.push(PathBuf::from(LIBRARY));
    v
}

fn open() -> Result<Api, String> {
    let mut tried = Vec::new();
    for path in candidates() {
        // SAFETY: opening the NIXL C API runs its (and its dependencies') initialisers;
        // that is the documented way to use the library and has no preconditions here.
        match unsafe { Library::new(&path) } {
            Ok(lib) => {
                let api = Api::resolve(lib, path.display().to_string())?;
                // SAFETY: `is_stub` takes no arguments and only reports a constant.
                if unsafe { (api.is_stub)() } {
                    tried.push(format!("{}: a stub build of the C API", path.display()));
                    continue;
                }
                return Ok(api);
            }
            Err(e) => tried.push(e.to_string()),
        }
    }
    Err(format!(
        "the NIXL runtime ({LIBRARY}) was not found: install it with `bash \
         scripts/setup-nixl.sh` (into .tools/nixl) or set {} to the directory holding it \
         [tried: {}]",
        crate::transfer::NIXL_LIB_ENV,
        tried.join("; ")
    ))
}

/// The C API, opened on the first call (the outcome, found or not, is kept for the
/// process).
pub fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(open).as_ref().map_err(Clone::clone)
}

/// A failed NIXL call: which call, and its status code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallError {
    pub call: &'static str,
    pub status: i32,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.status {
            -1 => "invalid parameter",
            -2 => "backend error",
            -3 => "invalid state",
            -4 => "exception",
            -5 => "no telemetry",
            -6 => "not found",
            -100 => "argument holds a NUL byte",
            -101 => "null handle returned",
            _ => "unknown status",
        };
        write!(f, "{} failed: {what} ({})", self.call, self.status)
    }
}

fn check(call: &'static str, status: Status) -> Result<(), CallError> {
    if status == SUCCESS {
        Ok(())
    } else {
        Err(CallError { call, status })
    }
}

fn cstring(call: &'static str, s: &str) -> Result<CString, CallError> {
    CString::new(s).map_err(|_| CallError { call, status: -100 })
}

fn non_null<T>(call: &'static str, p: *mut T) -> Result<*mut T, CallError> {
    if p.is_null() {
        Err(CallError { call, status: -101 })
    } else {
        Ok(p)
    }
}

/// Optional arguments of a call (backend hint, notification).
#[derive(Debug)]
pub struct OptArgs {
    api: &'static Api,
    raw: *mut RawOptArgs,
}

impl OptArgs {
    pub fn new(api: &'static Api) -> Result<Self, CallError> {
        let mut raw = ptr::null_mut();
        // SAFETY: the out-pointer is valid for the call.
        check("create_opt_args", unsafe {
            (api.create_opt_args)(&mut raw)
        })?;
        Ok(OptArgs {
            api,
            raw: non_null("create_opt_args", raw)?,
        })
    }

    /// Attaches a notification: `msg` is copied and delivered to the peer after the
    /// transfer's bytes landed.
    pub fn notify(&mut self, msg: &[u8]) -> Result<(), CallError> {
        // SAFETY: `raw` is live (owned by self); `msg` is valid for `len` bytes during
        // the call, and the C API copies it.
        unsafe {
            check(
                "opt_args_set_has_notif",
                (self.api.opt_args_set_has_notif)(self.raw, true),
            )?;
            check(
                "opt_args_set_notif_msg",
                (self.api.opt_args_set_notif_msg)(self.raw, msg.as_ptr().cast(), msg.len()),
            )
        }
    }
}

impl Drop for OptArgs {
    fn drop(&mut self) {
        // SAFETY: `raw` was created by `create_opt_args` and is destroyed once, here.
        unsafe { (self.api.destroy_opt_args)(self.raw) };
    }
}

/// A descriptor list of host memory ranges for one transfer.
#[derive(Debug)]
pub struct XferList {
    api: &'static Api,
    raw: *mut RawXferDlist,
}

impl XferList {
    pub fn new(api: &'static Api) -> Result<Self, CallError> {
        let mut raw = ptr::null_mut();
        // SAFETY: the out-pointer is valid for the call.
        check("create_xfer_dlist", unsafe {
            (api.create_xfer_dlist)(MEM_DRAM, &mut raw)
        })?;
        Ok(XferList {
            api,
            raw: non_null("create_xfer_dlist", raw)?,
        })
    }

    /// Adds `len` bytes at `addr` (an address in this process or the peer's; NIXL only
    /// records it here).
    pub fn push(&mut self, addr: usize, len: usize) -> Result<(), CallError> {
        // SAFETY: `raw` is live; the call records plain numbers.
        check("xfer_dlist_add_desc", unsafe {
            (self.api.xfer_dlist_add_desc)(self.raw, addr, len, 0)
        })
    }
}

impl Drop for XferList {
    fn drop(&mut self) {
        // SAFETY: `raw` was created by `create_xfer_dlist` and is destroyed once, here.
        unsafe { (self.api.destroy_xfer_dlist)(self.raw) };
    }
}

/// A registration descriptor list holding one host range.
struct RegList {
    api: &'static Api,
    raw: *mut RawRegDlist,
}

impl RegList {
    fn one(api: &'static Api, addr: usize, len: usize) -> Result<Self, CallError> {
        let mut raw = ptr::null_mut();
        // SAFETY: the out-pointer is valid for the call.
        check("create_reg_dlist", unsafe {
            (api.create_reg_dlist)(MEM_DRAM, &mut raw)
        })?;
        let l = RegList {
            api,
            raw: non_null("create_reg_dlist", raw)?,
        };
        // SAFETY: `raw` is live; no metadata blob is passed (null, length 0).
        check("reg_dlist_add_desc", unsafe {
            (api.reg_dlist_add_desc)(l.raw, addr, len, 0, ptr::null(), 0)
        })?;
        Ok(l)
    }
}

impl Drop for RegList {
    fn drop(&mut self) {
        // SAFETY: `raw` was created by `create_reg_dlist` and is destroyed once, here.
        unsafe { (self.api.destroy_reg_dlist)(self.raw) };
    }
}

/// A posted (or created) transfer request. Released through its agent
/// ([`Agent::release`]); dropping it unreleased leaks it rather than touching an agent
/// this value cannot lock.
#[derive(Debug)]
pub struct XferReq {
    raw: *mut RawXferReq,
}

// SAFETY: a request handle is a plain pointer into the agent's state; every use of it
// goes through `Agent` methods, which the owner serialises.
unsafe impl Send for XferReq {}

/// Where a posted transfer stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XferState {
    Done,
    InProgress,
}

/// A NIXL agent with one backend. Not thread-safe: methods take `&mut self`.
#[derive(Debug)]
pub struct Agent {
    api: &'static Api,
    raw: *mut RawAgent,
    backend: *mut RawBackend,
    /// Peers whose metadata is loaded (invalidated on drop).
    peers: Vec<String>,
}

// SAFETY: the agent object may be used from any thread as long as calls do not overlap
// (NIXL's thread_sync "none"); every method takes `&mut self`, so a shared agent must sit
// behind a lock.
unsafe impl Send for Agent {}

impl Agent {
    /// An agent named `name` without NIXL's progress and listener threads (the owner
    /// polls, and metadata travels over the owner's own connection), with a UCX backend
    /// whose parameters are the plugin's defaults plus `params`.
    pub fn with_ucx(
        api: &'static Api,
        name: &str,
        params: &[(&str, &str)],
    ) -> Result<Self, CallError> {
        let c_name = cstring("create_configured_agent", name)?;
        let cfg = AgentConfig {
            enable_prog_thread: false,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: 0,
            num_workers: 1,
            pthr_delay_us: 0,
            lthr_delay_us: 100_000,
            capture_telemetry: false,
        };
        let mut raw = ptr::null_mut();
        // SAFETY: name and config are valid for the call; the out-pointer is valid.
        check("create_configured_agent", unsafe {
            (api.create_configured_agent)(c_name.as_ptr(), &cfg, &mut raw)
        })?;
        let mut agent = Agent {
            api,
            raw: non_null("create_configured_agent", raw)?,
            backend: ptr::null_mut(),
            peers: Vec::new(),
        };
        let ucx = cstring("get_plugin_params", "UCX")?;
        let (mut mems, mut ps) = (ptr::null_mut(), ptr::null_mut());
        // SAFETY: the agent is live, the plugin name valid, the out-pointers valid. The
        // returned lists are owned here and destroyed below.
        let status =
            unsafe { (api.get_plugin_params)(agent.raw, ucx.as_ptr(), &mut mems, &mut ps) };
        let result = check("get_plugin_params", status).and_then(|()| {
            let ps = non_null("get_plugin_params", ps)?;
            for (k, v) in params {
                let (k, v) = (cstring("params_add", k)?, cstring("params_add", v)?);
                // SAFETY: `ps` is live; key and value are valid C strings for the call.
                check("params_add", unsafe {
                    (api.params_add)(ps, k.as_ptr(), v.as_ptr())
                })?;
            }
            let mut backend = ptr::null_mut();
            // SAFETY: agent, name and params are live; the out-pointer is valid.
            check("create_backend", unsafe {
                (api.create_backend)(agent.raw, ucx.as_ptr(), ps, &mut backend)
            })?;
            non_null("create_backend", backend)
        });
        // SAFETY: each list was returned by `get_plugin_params` and is destroyed once.
        unsafe {
            if !mems.is_null() {
                (api.destroy_mem_list)(mems);
            }
            if !ps.is_null() {
                (api.destroy_params)(ps);
            }
        }
        agent.backend = result?;
        Ok(agent)
    }

    fn opts(&self) -> Result<OptArgs, CallError> {
        let o = OptArgs::new(self.api)?;
        // SAFETY: both handles are live; the backend belongs to this agent.
        check("opt_args_add_backend", unsafe {
            (self.api.opt_args_add_backend)(o.raw, self.backend)
        })?;
        Ok(o)
    }

    /// Options naming this agent's backend, for a transfer.
    pub fn transfer_opts(&self) -> Result<OptArgs, CallError> {
        self.opts()
    }

    /// Registers `len` bytes of host memory at `addr`.
    ///
    /// # Safety
    /// The memory must stay allocated until [`Agent::deregister`] is called for it.
    pub unsafe fn register(&mut self, addr: usize, len: usize) -> Result<(), CallError> {
        let l = RegList::one(self.api, addr, len)?;
        let o = self.opts()?;
        // SAFETY: agent, list and options are live for the call.
        check("register_mem", unsafe {
            (self.api.register_mem)(self.raw, l.raw, o.raw)
        })
    }

    /// Undoes [`Agent::register`] of the same range.
    pub fn deregister(&mut self, addr: usize, len: usize) -> Result<(), CallError> {
        let l = RegList::one(self.api, addr, len)?;
        let o = self.opts()?;
        // SAFETY: agent, list and options are live for the call.
        check("deregister_mem", unsafe {
            (self.api.deregister_mem)(self.raw, l.raw, o.raw)
        })
    }

    /// This agent's metadata (what a peer loads to reach its registered memory).
    pub fn local_md(&mut self) -> Result<Vec<u8>, CallError> {
        let (mut data, mut len) = (ptr::null_mut::<c_void>(), 0usize);
        // SAFETY: the agent is live; the out-pointers are valid.
        check("get_local_md", unsafe {
            (self.api.get_local_md)(self.raw, &mut data, &mut len)
        })?;
        let data = non_null("get_local_md", data)?;
        // SAFETY: on success the C API hands us `len` bytes at `data`, allocated with
        // malloc; we copy them out and free them once.
        let v = unsafe {
            let v = std::slice::from_raw_parts(data as *const u8, len).to_vec();
            libc::free(data);
            v
        };
        Ok(v)
    }

    /// Loads a peer's metadata; returns the peer's agent name.
    pub fn load_remote_md(&mut self, md: &[u8]) -> Result<String, CallError> {
        let mut name = ptr::null_mut::<c_char>();
        // SAFETY: the agent is live, `md` valid for its length, the out-pointer valid.
        check("load_remote_md", unsafe {
            (self.api.load_remote_md)(self.raw, md.as_ptr().cast(), md.len(), &mut name)
        })?;
        let name = non_null("load_remote_md", name)?;
        // SAFETY: on success `name` is a malloc'd NUL-terminated string we own.
        let s = unsafe {
            let s = CStr::from_ptr(name).to_string_lossy().into_owned();
            libc::free(name.cast());
            s
        };
        if !self.peers.contains(&s) {
            self.peers.push(s.clone());
        }
        Ok(s)
    }

    /// Forgets a peer's metadata (after its connection ended). An unknown peer is not an
    /// error.
    pub fn forget(&mut self, peer: &str) {
        let Some(i) = self.peers.iter().position(|p| p == peer) else {
            return;
        };
        self.peers.swap_remove(i);
        if let Ok(c) = CString::new(peer) {
            // SAFETY: the agent is live; the name is a valid C string for the call.
            unsafe { (self.api.invalidate_remote_md)(self.raw, c.as_ptr()) };
        }
    }

    /// Creates and posts a write of `local` into `remote` at `peer`, with `opts` (its
    /// backend and notification). The request must be polled with [`Agent::status`] and
    /// released with [`Agent::release`].
    pub fn post_write(
        &mut self,
        local: &XferList,
        remote: &XferList,
        peer: &str,
        opts: &OptArgs,
    ) -> Result<XferReq, CallError> {
        let c_peer = cstring("create_xfer_req", peer)?;
        let mut raw = ptr::null_mut();
        // SAFETY: every handle is live for the call; the out-pointer is valid.
        check("create_xfer_req", unsafe {
            (self.api.create_xfer_req)(
                self.raw,
                OP_WRITE,
                local.raw,
                remote.raw,
                c_peer.as_ptr(),
                &mut raw,
                opts.raw,
            )
        })?;
        let req = XferReq {
            raw: non_null("create_xfer_req", raw)?,
        };
        // SAFETY: agent and request are live; no extra options (null is allowed).
        let status = unsafe { (self.api.post_xfer_req)(self.raw, req.raw, ptr::null_mut()) };
        match status {
            SUCCESS | IN_PROGRESS => Ok(req),
            status => {
                self.release(req);
                Err(CallError {
                    call: "post_xfer_req",
                    status,
                })
            }
        }
    }

    /// Polls a posted request (this also progresses the agent).
    pub fn status(&mut self, req: &XferReq) -> Result<XferState, CallError> {
        // SAFETY: agent and request are live.
        match unsafe { (self.api.get_xfer_status)(self.raw, req.raw) } {
            SUCCESS => Ok(XferState::Done),
            IN_PROGRESS => Ok(XferState::InProgress),
            status => Err(CallError {
                call: "get_xfer_status",
                status,
            }),
        }
    }

    /// Releases a request (aborting it if still in progress) and frees it.
    pub fn release(&mut self, req: XferReq) {
        // SAFETY: the request was created by this agent and is released and destroyed
        // once (it is consumed here).
        unsafe {
            (self.api.release_xfer_req)(self.raw, req.raw);
            (self.api.destroy_xfer_req)(req.raw);
        }
    }

    /// Sends `msg` to `peer` as a bare notification (no bytes moved).
    pub fn notify(&mut self, peer: &str, msg: &[u8]) -> Result<(), CallError> {
        let c_peer = cstring("gen_notif", peer)?;
        let o = self.opts()?;
        // SAFETY: agent, name, message and options are valid for the call.
        check("gen_notif", unsafe {
            (self.api.gen_notif)(
                self.raw,
                c_peer.as_ptr(),
                msg.as_ptr().cast(),
                msg.len(),
                o.raw,
            )
        })
    }

    /// The notifications that arrived from `peer` since the last call (each a copy).
    pub fn take_notifications(&mut self, peer: &str) -> Result<Vec<Vec<u8>>, CallError> {
        let c_peer = cstring("get_notifs", peer)?;
        let mut map = ptr::null_mut();
        // SAFETY: the out-pointer is valid.
        check("create_notif_map", unsafe {
            (self.api.create_notif_map)(&mut map)
        })?;
        let map = non_null("create_notif_map", map)?;
        let result = (|| {
            // SAFETY: agent and map are live; no options (null is allowed).
            check("get_notifs", unsafe {
                (self.api.get_notifs)(self.raw, map, ptr::null_mut())
            })?;
            let mut n = 0usize;
            // SAFETY: map and name are valid; a peer with no notifications reports an
            // error status, taken as none.
            let st = unsafe { (self.api.notif_map_get_notifs_size)(map, c_peer.as_ptr(), &mut n) };
            if st != SUCCESS {
                return Ok(Vec::new());
            }
            let mut out = Vec::with_capacity(n);
            for i in 0..n {
                let (mut data, mut len) = (ptr::null::<c_void>(), 0usize);
                // SAFETY: map and name are valid, `i < n`; the data is borrowed from the
                // map and copied before the map is destroyed.
                let st = unsafe {
                    (self.api.notif_map_get_notif)(map, c_peer.as_ptr(), i, &mut data, &mut len)
                };
                if st == SUCCESS {
                    out.push(if data.is_null() || len == 0 {
                        Vec::new()
                    } else {
                        // SAFETY: see above: `len` bytes at `data`, live until the map dies.
                        unsafe { std::slice::from_raw_parts(data as *const u8, len).to_vec() }
                    });
                }
            }
            Ok(out)
        })();
        // SAFETY: the map was created above and is destroyed once, here.
        unsafe { (self.api.destroy_notif_map)(map) };
        result
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        for p in std::mem::take(&mut self.peers) {
            if let Ok(c) = CString::new(p) {
                // SAFETY: the agent is live; the name is a valid C string.
                unsafe { (self.api.invalidate_remote_md)(self.raw, c.as_ptr()) };
            }
        }
        // SAFETY: the backend and agent were created here and are destroyed once, the
        // backend first.
        unsafe {
            if !self.backend.is_null() {
                (self.api.destroy_backend)(self.backend);
            }
            (self.api.destroy_agent)(self.raw);
        }
    }
}
