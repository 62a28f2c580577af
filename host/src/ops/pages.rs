//! `copy_pages` and `page_checksums`: whole pages between pools, and their checksums.

use super::{check_count, check_len, check_size};
use crate::error::{Error, Index, Result};
use crate::layout::PageLayout;

/// Where the pages of one layout sit in a buffer: page `i` occupies bytes
/// `offset + i·stride .. offset + i·stride + bytes_per_page`. A plain pool is
/// [`PagedRegion::contiguous`]; a page-first host pool (all layers of a page together)
/// has `stride = Σ layers' bytes_per_page` and a per-layer `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedRegion {
    pub layout: PageLayout,
    /// Bytes before page 0.
    pub offset: usize,
    /// Bytes from one page to the next (at least `bytes_per_page`).
    pub stride: usize,
    pub num_pages: usize,
}

impl PagedRegion {
    /// Pages packed back to back from byte 0.
    pub fn contiguous(layout: impl Into<PageLayout>, num_pages: usize) -> Self {
        let layout = layout.into();
        PagedRegion {
            layout,
            offset: 0,
            stride: layout.bytes_per_page(),
            num_pages,
        }
    }

    /// Checks the region fits a buffer of `buffer_bytes` bytes (checked arithmetic: a
    /// region whose end overflows is an error, never a wrapped small end).
    pub fn check(&self, what: &'static str, buffer_bytes: usize) -> Result<()> {
        let page = self.layout.bytes_per_page();
        if self.stride < page {
            return Err(Error::invalid(
                what,
                format!(
                    "stride {} is smaller than a page ({page} bytes)",
                    self.stride
                ),
            ));
        }
        check_count("num_pages", self.num_pages)?;
        let end = match self.num_pages {
            0 => Some(self.offset),
            n => (n - 1)
                .checked_mul(self.stride)
                .and_then(|x| x.checked_add(page))
                .and_then(|x| x.checked_add(self.offset)),
        };
        let Some(end) = end else {
            return Err(Error::invalid(
                what,
                format!(
                    "region end {} + ({} - 1) × {} + {page} overflows the address space",
                    self.offset, self.num_pages, self.stride
                ),
            ));
        };
        if end > buffer_bytes {
            return Err(Error::BufferSize {
                what,
                expected: end,
                actual: buffer_bytes,
            });
        }
        Ok(())
    }

    /// Byte range of page `id` (assumes a validated id).
    pub fn page_range(&self, id: usize) -> std::ops::Range<usize> {
        let start = self.offset + id * self.stride;
        start..start + self.layout.bytes_per_page()
    }

    fn check_ids(&self, what: &'static str, ids: &[i32]) -> Result<()> {
        for (i, &p) in ids.iter().enumerate() {
            if p < 0 || p as usize >= self.num_pages {
                return Err(Error::PageOutOfRange {
                    what,
                    index: Index::Flat(i),
                    page: p as i64,
                    num_pages: self.num_pages,
                });
            }
        }
        Ok(())
    }
}

/// `copy_pages`: page `src_ids[i]` of `src` is copied to page `dst_ids[i]` of `dst`. The two
/// regions must carry the same layout descriptor (same fingerprint): a page is never
/// reinterpreted in another layout.
#[derive(Clone, Copy, Debug)]
pub struct CopyPages<'a> {
    pub src: PagedRegion,
    pub dst: PagedRegion,
    pub src_ids: &'a [i32],
    pub dst_ids: &'a [i32],
}

impl CopyPages<'_> {
    /// Validates the call against the buffer sizes (bytes).
    pub fn validate(&self, src_bytes: usize, dst_bytes: usize) -> Result<()> {
        let (fs, fd) = (self.src.layout.fingerprint(), self.dst.layout.fingerprint());
        if fs != fd {
            return Err(Error::LayoutMismatch {
                what: "copy_pages destination",
                expected: fs,
                actual: fd,
            });
        }
        check_len("dst_ids", self.src_ids.len(), self.dst_ids.len())?;
        check_count("pages copied", self.src_ids.len())?;
        self.src.check("copy_pages source", src_bytes)?;
        self.dst.check("copy_pages destination", dst_bytes)?;
        self.src.check_ids("src_ids", self.src_ids)?;
        self.dst.check_ids("dst_ids", self.dst_ids)?;
        let mut seen = std::collections::HashMap::with_capacity(self.dst_ids.len());
        for (i, &p) in self.dst_ids.iter().enumerate() {
            if let Some(first) = seen.insert(p, i) {
                return Err(Error::DuplicatePage {
                    what: "dst_ids",
                    page: p as i64,
                    first,
                    second: i,
                });
            }
        }
        Ok(())
    }
}

/// `page_checksums`: the 64-bit checksum (`sparsekit_kernels::checksum`) of each page
/// `ids[i]` of `region`, written as u64 `[ids.len()]`.
#[derive(Clone, Copy, Debug)]
pub struct PageChecksums<'a> {
    pub region: PagedRegion,
    pub ids: &'a [i32],
}

impl PageChecksums<'_> {
    /// Validates the call against the buffer sizes (bytes).
    pub fn validate(&self, pool_bytes: usize, out_bytes: usize) -> Result<()> {
        self.region.check("page_checksums pool", pool_bytes)?;
        check_count("ids", self.ids.len())?;
        self.region.check_ids("ids", self.ids)?;
        check_size("checksums", &[self.ids.len(), 8], out_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{IndexKDtype, IndexKLayout, KvDtype, KvLayout};
    #[test]
    fn copy_validation() {
        let a = IndexKLayout::new(IndexKDtype::FP8, 128, 64).unwrap();
        let b = IndexKLayout::new(IndexKDtype::Bf16, 128, 64).unwrap();
        let src = PagedRegion::contiguous(a, 4);
        let ok = CopyPages {
            src,
            dst: PagedRegion::contiguous(a, 3),
            src_ids: &[0, 3],
            dst_ids: &[2, 0],
        };
        assert!(ok.validate(a.buffer_bytes(4), a.buffer_bytes(3)).is_ok());
        // The historical bug: a bf16 pool mirrored with an fp8 descriptor.
        let bad = CopyPages {
            dst: PagedRegion::contiguous(b, 3),
            ..ok
        };
        assert!(matches!(
            bad.validate(a.buffer_bytes(4), b.buffer_bytes(3)),
            Err(Error::LayoutMismatch { .. })
        ));
        let kv = KvLayout::new(KvDtype::Bf16, 512, 64, 64).unwrap();
        let bad = CopyPages {
            dst: PagedRegion::contiguous(kv, 3),
            ..ok
        };
        assert!(matches!(
            bad.validate(a.buffer_bytes(4), kv.buffer_bytes(3)),
            Err(Error::LayoutMismatch { .. })
        ));
        assert!(matches!(
            ok.validate(a.buffer_bytes(4), a.buffer_bytes(3) - 1),
            Err(Error::BufferSize { .. })
        ));
        let dup = CopyPages {
            dst_ids: &[1, 1],
            ..ok
        };
        assert!(matches!(
            dup.validate(a.buffer_bytes(4), a.buffer_bytes(3)),
            Err(Error::DuplicatePage { .. })
        ));
        let oob = CopyPages {
            src_ids: &[4, 0],
            ..ok
        };
        assert!(matches!(
            oob.validate(a.buffer_bytes(4), a.buffer_bytes(3)),
            Err(Error::PageOutOfRange { page: 4, .. })
        ));
        let neg = CopyPages {
            dst_ids: &[-1, 0],
            ..ok
        };
        assert!(matches!(
            neg.validate(a.buffer_bytes(4), a.buffer_bytes(3)),
            Err(Error::PageOutOfRange { page: -1, .. })
        ));
        let short = CopyPages {
            dst_ids: &[0],
            ..ok
        };
        assert!(matches!(
            short.validate(a.buffer_bytes(4), a.buffer_bytes(3)),
            Err(Error::Shape { .. })
        ));
        let narrow = CopyPages {
            src: PagedRegion { stride: 100, ..src },
            ..ok
        };
        assert!(narrow
            .validate(a.buffer_bytes(4), a.buffer_bytes(3))
            .is_err());
    }

    #[test]
    fn region_ends_never_wrap() {
        let a = IndexKLayout::new(IndexKDtype::FP8, 128, 64).unwrap();
        let page = a.bytes_per_page();
        let wraps = [
            PagedRegion {
                offset: usize::MAX - 99,
                ..PagedRegion::contiguous(a, 1)
            },
            PagedRegion {
                stride: 1 << 63,
                ..PagedRegion::contiguous(a, 3)
            },
            PagedRegion {
                num_pages: usize::MAX,
                ..PagedRegion::contiguous(a, 1)
            },
        ];
        for r in wraps {
            assert!(
                matches!(r.check("x", 4 * page), Err(Error::InvalidArgument { .. })),
                "{r:?}"
            );
        }
        let op = CopyPages {
            src: PagedRegion::contiguous(a, 2),
            dst: PagedRegion {
                offset: usize::MAX - 99,
                ..PagedRegion::contiguous(a, 2)
            },
            src_ids: &[0],
            dst_ids: &[1],
        };
        assert!(op.validate(2 * page, 2 * page).is_err());
        let e = PageChecksums {
            region: PagedRegion::contiguous(a, 2),
            ids: &[0, 5],
        }
        .validate(2 * page, 16)
        .unwrap_err();
        assert!(e.to_string().contains("ids[1] = page 5"), "{e}");
    }

    #[test]
    fn checksum_validation() {
        let a = IndexKLayout::new(IndexKDtype::FP8, 128, 64).unwrap();
        let op = PageChecksums {
            region: PagedRegion::contiguous(a, 2),
            ids: &[1, 0, 1],
        };
        assert!(op.validate(a.buffer_bytes(2), 24).is_ok());
        assert!(matches!(
            op.validate(a.buffer_bytes(2), 16),
            Err(Error::BufferSize { .. })
        ));
        let op = PageChecksums { ids: &[2], ..op };
        assert!(matches!(
            op.validate(a.buffer_bytes(2), 8),
            Err(Error::PageOutOfRange { .. })
        ));
    }
}
