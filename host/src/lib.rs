//! sparsekit host side: element types, layout descriptors (the only place byte sizes are
//! computed), op descriptors, the [`Backend`] trait and the multi-threaded CPU backend.

pub mod backend;
pub mod cache;
pub mod cpu;
pub mod dims;
pub mod dtype;
pub mod emu;
pub mod error;
pub mod kernel_params;
pub mod layout;
pub mod model_ops;
pub mod ops;

pub use backend::Backend;
pub use cpu::CpuBackend;
pub use dims::ModelDims;
pub use emu::EmuBackend;
pub use error::{Error, Result};
pub use layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
pub use model_ops::ModelOps;
