//! Page gather/scatter between two pools and per-page checksums: one block per page,
//! grid-stride over pages.

use super::warp_sum_u64;
use crate::checksum::{finish, word_term};
use crate::global::V4;
use crate::params::{CopyPagesParams, PageChecksumsParams};
use crate::simt::Simt;

/// Copies pages between pools.
///
/// # Safety
/// Every `src_ids[i]`/`dst_ids[i]` (`i < n_pages`) names a page whose `bytes` bytes lie in
/// its pool; `dst_ids` are unique; source and destination pages do not overlap.
pub unsafe fn copy_pages<S: Simt>(p: CopyPagesParams) {
    let vector = (p.src.addr() | p.dst.addr()) % 16 == 0
        && (p.src_stride | p.dst_stride | p.bytes) % 16 == 0;
    let mut i = S::block_idx();
    while i < p.n_pages {
        // SAFETY: i < n_pages (contract).
        let (s, d) = unsafe {
            (
                S::gld(p.src_ids.add(i as usize)),
                S::gld(p.dst_ids.add(i as usize)),
            )
        };
        let src = p.src.byte_add(s as usize * p.src_stride as usize);
        let dst = p.dst.byte_add(d as usize * p.dst_stride as usize);
        if vector {
            let (src, dst) = (src.cast::<V4>(), dst.cast::<V4>());
            let mut j = S::thread_idx() as u64;
            while j < p.bytes / 16 {
                // SAFETY: 16-byte aligned (checked) and j < bytes/16: inside both pages.
                unsafe { S::gst(dst.add(j as usize), S::gld(src.add(j as usize))) };
                j += S::block_dim() as u64;
            }
        } else {
            let mut j = S::thread_idx() as u64;
            while j < p.bytes {
                // SAFETY: j < bytes: inside both pages.
                unsafe { S::gst(dst.add(j as usize), S::gld(src.add(j as usize))) };
                j += S::block_dim() as u64;
            }
        }
        i += S::grid_dim();
    }
}

/// Checksums pages (see [`crate::checksum`]).
///
/// # Safety
/// Launch with `block_dim` a multiple of 32 and `block_dim / 32 * 8` bytes of dynamic
/// shared memory. Every `ids[i]` names a page whose `bytes` bytes lie in the pool; `out`
/// holds `n_pages` u64.
pub unsafe fn page_checksums<S: Simt>(p: PageChecksumsParams) {
    let warps = S::block_dim() / 32;
    let words = p.bytes.div_ceil(8);
    let mut i = S::block_idx();
    while i < p.n_pages {
        // SAFETY: i < n_pages (contract).
        let id = unsafe { S::gld(p.ids.add(i as usize)) };
        let page = p.pool.byte_add(id as usize * p.stride as usize);
        let mut sum = 0u64;
        let mut w = S::thread_idx() as u64;
        while w < words {
            // Little-endian word, zero-padded past the page end.
            let n = if (w + 1) * 8 <= p.bytes {
                8
            } else {
                (p.bytes - w * 8) as usize
            };
            let mut word = 0u64;
            let mut b = 0;
            while b < n {
                // SAFETY: w*8 + b < bytes: inside the page.
                word |= (unsafe { S::gld(page.add(w as usize * 8 + b)) } as u64) << (8 * b);
                b += 1;
            }
            sum = sum.wrapping_add(word_term(word, w));
            w += S::block_dim() as u64;
        }
        let sum = warp_sum_u64::<S>(sum);
        if S::lane_id() == 0 {
            // SAFETY: warp_id < warps; the launch provides warps * 8 bytes.
            unsafe { S::smem_store::<u64>(S::warp_id() as usize * 8, sum) };
        }
        S::sync_threads();
        if S::thread_idx() == 0 {
            let mut total = 0u64;
            let mut k = 0;
            while k < warps {
                // SAFETY: written by warp k's lane 0 before the barrier.
                total = total.wrapping_add(unsafe { S::smem_load::<u64>(k as usize * 8) });
                k += 1;
            }
            // SAFETY: i < n_pages.
            unsafe { S::gst(p.out.add(i as usize), finish(total, p.bytes)) };
        }
        // Shared partials are rewritten for the next page only after everyone is done.
        S::sync_threads();
        i += S::grid_dim();
    }
}
