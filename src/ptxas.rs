//! What `ptxas -v` and `cuobjdump --dump-sass` say about the kernels, parsed once: the
//! build script (`build.rs` includes this file) gates the build on it (no spills at
//! sm_90/sm_120) and embeds the logs, and [`crate::kernel_report`] reads the same logs
//! with the same parser. Plain `std`, no crate dependencies.

/// What ptxas reported for one function.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PtxasFunction {
    pub name: String,
    /// An `.entry` (kernel); `false` for a device function ptxas compiled on its own (not
    /// inlined), whose stack and spills count for every kernel that calls it.
    pub entry: bool,
    pub registers: u32,
    /// Spill stores, bytes.
    pub spill_store_bytes: u32,
    /// Spill loads, bytes.
    pub spill_load_bytes: u32,
    /// Stack frame, bytes.
    pub stack_bytes: u32,
    /// Static shared memory, bytes.
    pub shared_bytes: u32,
    pub barriers: u32,
}

impl PtxasFunction {
    /// Spill stores + spill loads, bytes.
    pub fn spill_bytes(&self) -> u32 {
        self.spill_store_bytes + self.spill_load_bytes
    }
}

/// The number before `unit` in the comma-separated list `s` (`"40 registers, used 1
/// barriers"`), 0 when absent.
fn number_before(s: &str, unit: &str) -> u32 {
    s.split(',')
        .find(|p| p.contains(unit))
        .and_then(|p| p.split_whitespace().find_map(|w| w.parse::<u32>().ok()))
        .unwrap_or(0)
}

/// Parses a `ptxas -v` log: one record per function, entries and device functions alike,
/// in log order. A function's stack frame and spills come from its own `Function
/// properties` block, its registers, shared memory and barriers from the `Used` line that
/// follows its `Compiling` line.
pub fn parse_ptxas_log(log: &str) -> Vec<PtxasFunction> {
    let mut out: Vec<PtxasFunction> = Vec::new();
    let find = |out: &mut Vec<PtxasFunction>, name: &str| -> usize {
        match out.iter().position(|f| f.name == name) {
            Some(i) => i,
            None => {
                out.push(PtxasFunction {
                    name: name.to_string(),
                    ..PtxasFunction::default()
                });
                out.len() - 1
            }
        }
    };
    // The function the next `Used` line belongs to, and the one whose properties follow.
    let (mut compiling, mut properties): (Option<usize>, Option<usize>) = (None, None);
    for line in log.lines() {
        if let Some(rest) = line
            .split("Compiling entry function '")
            .nth(1)
            .or_else(|| line.split("Compiling function '").nth(1))
        {
            let name = rest.split('\'').next().unwrap_or("");
            let i = find(&mut out, name);
            out[i].entry |= line.contains("entry function");
            compiling = Some(i);
            properties = None;
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            properties = Some(find(&mut out, rest.trim()));
        } else if line.contains("bytes stack frame") {
            if let Some(i) = properties.take() {
                out[i].stack_bytes = number_before(line, "stack frame");
                out[i].spill_store_bytes = number_before(line, "spill stores");
                out[i].spill_load_bytes = number_before(line, "spill loads");
            }
        } else if let Some(used) = line.split("Used ").nth(1) {
            if let Some(i) = compiling.take() {
                out[i].registers = number_before(used, "registers");
                out[i].barriers = number_before(used, "barrier");
                out[i].shared_bytes = number_before(used, "smem");
            }
        }
    }
    out
}

/// Tensor-core instructions per function in a `cuobjdump --dump-sass` listing:
/// `(function, HMMA count, QMMA count)`.
pub fn parse_sass(dump: &str) -> Vec<(String, u32, u32)> {
    let mut out: Vec<(String, u32, u32)> = Vec::new();
    for line in dump.lines() {
        if let Some(rest) = line.trim().strip_prefix("Function : ") {
            out.push((rest.trim().to_string(), 0, 0));
        } else if let Some((_, h, q)) = out.last_mut() {
            *h += line.matches("HMMA").count() as u32;
            *q += line.matches("QMMA").count() as u32;
        }
    }
    out
}

/// The embedded form of [`parse_sass`]'s result: one `name\tHMMA\tQMMA` line each.
pub fn sass_to_tsv(counts: &[(String, u32, u32)]) -> String {
    counts
        .iter()
        .map(|(n, h, q)| format!("{n}\t{h}\t{q}\n"))
        .collect()
}

/// Reads [`sass_to_tsv`]'s lines back (malformed lines are skipped).
pub fn sass_from_tsv(tsv: &str) -> Vec<(String, u32, u32)> {
    tsv.lines()
        .filter_map(|l| {
            let mut it = l.split('\t');
            Some((
                it.next()?.to_string(),
                it.next()?.parse().ok()?,
                it.next()?.parse().ok()?,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log with a device function ptxas compiled on its own, before and after the entry.
    const LOG: &str = "ptxas info    : 0 bytes gmem
ptxas info    : Function properties for helper_not_inlined
    96 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Compiling entry function 'copy_pages' for 'sm_90'
ptxas info    : Function properties for copy_pages
    16 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 22 registers, used 1 barriers, 64 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 5.684 ms
ptxas info    : Compiling entry function 'topk' for 'sm_90'
ptxas info    : Function properties for topk
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers
";

    #[test]
    fn entries_and_functions_keep_their_own_properties() {
        let r = parse_ptxas_log(LOG);
        assert_eq!(r.len(), 3);
        let helper = &r[0];
        assert!(!helper.entry);
        assert_eq!(
            (helper.stack_bytes, helper.spill_bytes()),
            (96, 20),
            "a device function's frame is its own"
        );
        let copy = &r[1];
        assert!(copy.entry);
        assert_eq!(copy.name, "copy_pages");
        assert_eq!(copy.registers, 22);
        assert_eq!(copy.stack_bytes, 16, "not the helper's 96");
        assert_eq!(copy.spill_bytes(), 8);
        assert_eq!(copy.shared_bytes, 64);
        assert_eq!(copy.barriers, 1);
        let topk = &r[2];
        assert_eq!(
            (topk.registers, topk.spill_bytes(), topk.shared_bytes),
            (40, 0, 0)
        );
    }

    #[test]
    fn sass_counts_round_trip() {
        let dump = "\n\tFunction : sparse_mla\n  /*0010*/ HMMA.16816.F32.BF16 R0, R4, R8, R0 ;\n  /*0020*/ HMMA.16816.F32.BF16 R0, R4, R8, R0 ;\n\tFunction : topk\n  /*0010*/ IADD3 R0, R1, R2, RZ ;\n";
        let c = parse_sass(dump);
        assert_eq!(c, vec![("sparse_mla".into(), 2, 0), ("topk".into(), 0, 0)]);
        assert_eq!(sass_from_tsv(&sass_to_tsv(&c)), c);
        assert!(sass_from_tsv("broken line\n").is_empty());
    }
}
