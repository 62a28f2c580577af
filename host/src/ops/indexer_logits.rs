//! `indexer_logits`: the lightning indexer's logits over paged index keys.

use super::batch::check_rows;
use super::{check_count, check_len, check_size, decode_rows, PageTable, QueryRange};
use crate::error::{Error, Result};
use crate::layout::IndexKLayout;

/// `indexer_logits`: `I[t, s] = Σ_h w[t,h] · ReLU(q[t,h] · k[s]) · k_scale[s]` for every row
/// `t` and every position `s` in the row's range; every other column of the row up to
/// `row_stride` is `-inf`. Keys are read from the paged index-K buffer through the page
/// table (bf16 keys have scale 1).
#[derive(Clone, Debug)]
pub struct IndexerLogits<'a> {
    pub layout: IndexKLayout,
    pub n_heads: usize,
    pub page_table: PageTable<'a>,
    pub rows: Vec<QueryRange>,
    pub row_stride: usize,
}

impl<'a> IndexerLogits<'a> {
    /// Decode form: per request, `next_n` queries over its `context_lens[r]` tokens (causal).
    pub fn decode(
        layout: IndexKLayout,
        n_heads: usize,
        page_table: PageTable<'a>,
        context_lens: &[u32],
        next_n: usize,
        row_stride: usize,
    ) -> Result<Self> {
        check_len(
            "context_lens",
            page_table.num_requests(),
            context_lens.len(),
        )?;
        Ok(IndexerLogits {
            layout,
            n_heads,
            page_table,
            rows: decode_rows(context_lens, next_n)?,
            row_stride,
        })
    }

    /// Validates the call against the buffer sizes (bytes); returns the pages in the cache.
    /// Page-table entries outside every row's `[start, end)` are not read and need not be
    /// mapped.
    pub fn validate(
        &self,
        q_bytes: usize,
        weights_bytes: usize,
        cache_bytes: usize,
        out_bytes: usize,
    ) -> Result<usize> {
        if self.n_heads == 0 {
            return Err(Error::invalid("n_heads", "must be positive"));
        }
        let n = self.rows.len();
        check_count("rows", n)?;
        check_count("n_heads", self.n_heads)?;
        check_count("row_stride", self.row_stride)?;
        check_count("page_table columns", self.page_table.max_pages())?;
        let d = self.layout.head_dim();
        check_size("q", &[n, self.n_heads, d, 2], q_bytes)?;
        check_size("weights", &[n, self.n_heads, 4], weights_bytes)?;
        check_size("logits", &[n, self.row_stride, 4], out_bytes)?;
        let pages = self.layout.pages_in("index-K cache", cache_bytes)?;
        check_rows(
            &self.rows,
            &self.page_table,
            self.layout.page_size(),
            pages,
            self.row_stride,
        )?;
        Ok(pages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::IndexKDtype;
    #[test]
    fn indexer_validation_errors() {
        let layout = IndexKLayout::new(IndexKDtype::Bf16, 16, 4).unwrap();
        let pages = [0, 1, -1, 0, 0, 0];
        let pt = PageTable::new(&pages, 3).unwrap();
        let op = IndexerLogits::decode(layout, 2, pt, &[8, 3], 1, 8).unwrap();
        let cache = layout.buffer_bytes(2);
        let (q, w, out) = (2 * 2 * 16 * 2, 2 * 2 * 4, 2 * 8 * 4);
        assert_eq!(op.validate(q, w, cache, out).unwrap(), 2);
        assert!(matches!(
            op.validate(q + 2, w, cache, out),
            Err(Error::BufferSize { what: "q", .. })
        ));
        assert!(matches!(
            op.validate(q, w, cache + 1, out),
            Err(Error::BufferSize { .. })
        ));
        // A pool of one page does not hold page 1.
        assert!(matches!(
            op.validate(q, w, layout.buffer_bytes(1), out),
            Err(Error::PageOutOfRange { page: 1, .. })
        ));
        // Context 9 reaches the unmapped third entry.
        let op = IndexerLogits::decode(layout, 2, pt, &[9, 3], 1, 9).unwrap();
        assert!(matches!(
            op.validate(q, w, cache, 2 * 9 * 4),
            Err(Error::PageOutOfRange { page: -1, .. })
        ));
        // Row stride too small for the context.
        let op = IndexerLogits::decode(layout, 2, pt, &[8, 3], 1, 7).unwrap();
        assert!(matches!(
            op.validate(q, w, cache, 2 * 7 * 4),
            Err(Error::InvalidRange { row: 0, .. })
        ));
        assert!(PageTable::new(&pages, 4).is_err());
    }
}
