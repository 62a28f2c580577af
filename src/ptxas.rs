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

/// Warp-wide instructions of one function: every lane (of the mask) must execute each
/// together, so none may sit in lane-divergent control flow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WarpOps {
    pub mma: u32,
    pub shfl: u32,
    pub vote: u32,
    /// Block-wide barriers (`bar.sync` / `barrier.sync`) and warp barriers.
    pub bar: u32,
}

impl WarpOps {
    /// Counts the warp-wide mnemonics in one line of PTX (or of an inline asm string).
    fn add_text(&mut self, text: &str) {
        self.mma += text.matches("mma.sync").count() as u32;
        self.shfl += text.matches("shfl.sync").count() as u32;
        self.vote += text.matches("vote.sync").count() as u32;
        self.bar += (text.matches("bar.sync").count()
            + text.matches("barrier.sync").count()
            + text.matches("barrier.cta.sync").count()
            + text.matches("bar.warp.sync").count()) as u32;
    }
}

/// The end (exclusive byte index) of the argument list of the inline asm call on `line`:
/// after `asm [flags] "<asm>", "<constraints>"(<args>)`. `None` for other lines.
fn asm_call_args_end(line: &str) -> Option<usize> {
    let at = line.find(" asm ")? + 5;
    let b = line.as_bytes();
    let mut i = at;
    // Two quoted strings (the asm text and the constraints; `"` inside is escaped as \22).
    for _ in 0..2 {
        i += line[i..].find('"')? + 1;
        i += line[i..].find('"')? + 1;
    }
    i += line[i..].find('(')?;
    let mut depth = 0usize;
    while i < b.len() {
        match b[i] {
            b'(' => depth += 1,
            b')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// The asm text of the inline asm call on `line` (its first quoted string).
fn asm_text(line: &str) -> Option<&str> {
    let at = line.find(" asm ")? + 5;
    let start = at + line[at..].find('"')? + 1;
    let len = line[start..].find('"')?;
    Some(&line[start..start + len])
}

/// Whether `text` (an asm string) holds one of `mnemonics`.
fn is_warp_wide(text: &str, mnemonics: &[&str]) -> bool {
    mnemonics.iter().any(|m| text.contains(m))
}

/// Marks every inline asm call whose asm text holds one of `mnemonics` as `convergent`
/// (a call-site attribute after the argument list) in textual LLVM IR; returns the new IR
/// and the number of calls marked.
pub fn mark_convergent(ll: &str, mnemonics: &[&str]) -> (String, usize) {
    let mut out = String::with_capacity(ll.len() + 1024);
    let mut n = 0;
    for line in ll.lines() {
        let warp =
            line.contains("call ") && asm_text(line).is_some_and(|t| is_warp_wide(t, mnemonics));
        match asm_call_args_end(line).filter(|_| warp) {
            Some(end) => {
                out.push_str(&line[..end]);
                out.push_str(" convergent");
                out.push_str(&line[end..]);
                n += 1;
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    (out, n)
}

/// Warp-wide calls of one function of (optimised) LLVM IR.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IrWarpOps {
    pub name: String,
    pub ops: WarpOps,
    /// Warp-wide inline asm calls that are not `convergent`.
    pub non_convergent: u32,
}

/// The symbol after `@` (quoted or not) up to `(`.
fn symbol_after_at(s: &str) -> Option<String> {
    let at = s.find('@')? + 1;
    let rest = &s[at..];
    if let Some(q) = rest.strip_prefix('"') {
        return Some(q[..q.find('"')?].to_string());
    }
    let end = rest.find(|c: char| c == '(' || c.is_whitespace())?;
    Some(rest[..end].to_string())
}

/// Per function of textual LLVM IR: its warp-wide calls (inline asm holding one of
/// `mnemonics`, NVVM shuffle, vote and barrier intrinsics) and how many of the asm ones
/// lack `convergent` (on the call or in its attribute group).
pub fn ir_warp_ops(ll: &str, mnemonics: &[&str]) -> Vec<IrWarpOps> {
    let convergent_groups: Vec<String> = ll
        .lines()
        .filter_map(|l| l.strip_prefix("attributes #"))
        .filter(|l| {
            l.split(|c: char| !c.is_alphanumeric() && c != '_')
                .any(|w| w == "convergent")
        })
        .filter_map(|l| l.split_whitespace().next().map(|n| format!("#{n}")))
        .collect();
    let mut out: Vec<IrWarpOps> = Vec::new();
    let mut cur: Option<IrWarpOps> = None;
    for line in ll.lines() {
        if line.starts_with("define ") {
            cur = symbol_after_at(line).map(|name| IrWarpOps {
                name,
                ..IrWarpOps::default()
            });
            continue;
        }
        if line == "}" {
            out.extend(cur.take());
            continue;
        }
        let Some(f) = cur.as_mut() else { continue };
        if !line.contains("call ") {
            continue;
        }
        if let Some(text) = asm_text(line).filter(|t| is_warp_wide(t, mnemonics)) {
            f.ops.add_text(text);
            let tail = asm_call_args_end(line).map_or("", |e| &line[e..]);
            let convergent = tail.contains("convergent")
                || tail
                    .split(|c: char| c == ',' || c.is_whitespace())
                    .any(|w| convergent_groups.iter().any(|g| g == w));
            if !convergent {
                f.non_convergent += 1;
            }
        } else if let Some(callee) = symbol_after_at(line.split(" call ").nth(1).unwrap_or("")) {
            if callee.starts_with("llvm.nvvm.shfl.sync.") {
                f.ops.shfl += 1;
            } else if callee.starts_with("llvm.nvvm.vote.") {
                f.ops.vote += 1;
            } else if callee.starts_with("llvm.nvvm.barrier")
                || callee.starts_with("llvm.nvvm.bar.")
            {
                f.ops.bar += 1;
            }
        }
    }
    out
}

/// Warp-wide instructions of one PTX function.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PtxWarpOps {
    pub name: String,
    pub ops: WarpOps,
}

/// The name declared by a PTX `.entry` / `.func` header line.
fn ptx_function_name(line: &str) -> Option<String> {
    let kw = [".entry ", ".func "]
        .iter()
        .find_map(|k| line.find(k).map(|i| i + k.len()))?;
    let mut rest = line[kw..].trim_start();
    if rest.starts_with('(') {
        // A return parameter list: `(.param ...) name(`.
        let close = rest.find(')')?;
        rest = rest[close + 1..].trim_start();
    }
    let end = rest
        .find(|c: char| c == '(' || c == ';' || c.is_whitespace())
        .unwrap_or(rest.len());
    (end > 0).then(|| rest[..end].to_string())
}

/// Per function with a body in PTX: its warp-wide instructions.
pub fn ptx_warp_ops(ptx: &str) -> Vec<PtxWarpOps> {
    let mut out = Vec::new();
    let mut pending: Option<String> = None;
    let mut cur: Option<PtxWarpOps> = None;
    for line in ptx.lines() {
        let code = line.split("//").next().unwrap_or("");
        if cur.is_none() {
            if !code.starts_with(' ') && !code.starts_with('\t') {
                if let Some(name) = ptx_function_name(code) {
                    pending = (!code.trim_end().ends_with(';')).then_some(name);
                    continue;
                }
            }
            if code.starts_with('{') {
                if let Some(name) = pending.take() {
                    cur = Some(PtxWarpOps {
                        name,
                        ops: WarpOps::default(),
                    });
                }
            }
            continue;
        }
        if code.starts_with('}') {
            out.extend(cur.take());
            continue;
        }
        if let Some(f) = cur.as_mut() {
            f.ops.add_text(code);
        }
    }
    out
}

/// Reads the embedded `function\tmma\tshfl\tvote\tbar` lines back.
pub fn warp_ops_from_tsv(tsv: &str) -> Vec<PtxWarpOps> {
    tsv.lines()
        .filter_map(|l| {
            let mut it = l.split('\t');
            let name = it.next()?.to_string();
            let mut n = || it.next()?.parse::<u32>().ok();
            Some(PtxWarpOps {
                name,
                ops: WarpOps {
                    mma: n()?,
                    shfl: n()?,
                    vote: n()?,
                    bar: n()?,
                },
            })
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

    const IR: &str = r#"define void @k(ptr %p) #0 {
start:
  %a = tail call i32 @llvm.nvvm.shfl.sync.bfly.i32(i32 -1, i32 1, i32 1, i32 31)
  %b = call { float, float } asm sideeffect "mma.sync.aligned.m16n8k16 {$0, $1}, {$2};", "=r,=r,r"(i32 %a) #3, !srcloc !1
  %c = call i32 asm "ld.global.u32 $0, [$1];", "=r,l"(ptr %p) #4
  %d = tail call i32 @llvm.nvvm.vote.ballot.sync(i32 -1, i1 true)
  call void @llvm.nvvm.barrier0()
  ret void
}

define internal void @helper() {
  %x = call float asm sideeffect "mma.sync.aligned.x $0;", "=r"() #4
  ret void
}

declare i32 @llvm.nvvm.shfl.sync.bfly.i32(i32, i32, i32, i32) #1
attributes #0 = { nounwind }
attributes #3 = { convergent nounwind }
attributes #4 = { nounwind memory(none) }
"#;

    #[test]
    fn marks_warp_wide_asm_convergent() {
        let (marked, n) = mark_convergent(IR, &["mma.sync"]);
        assert_eq!(n, 2);
        assert!(
            marked.contains(r#""=r,=r,r"(i32 %a) convergent #3"#),
            "{marked}"
        );
        assert!(marked.contains(r#""=r"() convergent #4"#), "{marked}");
        assert!(
            !marked.contains(r#"(ptr %p) convergent"#),
            "loads are not marked"
        );
        let after = ir_warp_ops(&marked, &["mma.sync"]);
        assert!(after.iter().all(|f| f.non_convergent == 0));
    }

    #[test]
    fn counts_ir_warp_ops_per_function() {
        let f = ir_warp_ops(IR, &["mma.sync"]);
        assert_eq!(f.len(), 2);
        assert_eq!(f[0].name, "k");
        assert_eq!(
            f[0].ops,
            WarpOps {
                mma: 1,
                shfl: 1,
                vote: 1,
                bar: 1
            }
        );
        assert_eq!(f[0].non_convergent, 0, "group #3 is convergent");
        assert_eq!(
            (f[1].name.as_str(), f[1].ops.mma, f[1].non_convergent),
            ("helper", 1, 1)
        );
    }

    #[test]
    fn counts_ptx_warp_ops_per_function() {
        let ptx = ".extern .func  (.param .b32 r) ext(.param .b32 a);\n\
.visible .entry k(\n\t.param .b64 p\n)\n{\n\
\tshfl.sync.bfly.b32 \t%r2, %r1, 1, 31, -1;\n\
\t// begin inline asm\n\
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%r1}, {%r2}, {%r3}, {%r4};\n\
\t{ .reg .u64 g; cvta.to.global.u64 g, %rd1; ld.global.u32 %r5, [g]; }\n\
\t// end inline asm\n\
\t@%p1 bar.sync \t0;\n\
\tvote.sync.ballot.b32 \t%r3, %p1, -1; // mma.sync in a comment\n\
}\n\
.func  (.param .b32 func_retval0) helper(\n)\n{\n\tbar.sync 0;\n}\n";
        let f = ptx_warp_ops(ptx);
        assert_eq!(f.len(), 2, "{f:?}");
        assert_eq!(f[0].name, "k");
        assert_eq!(
            f[0].ops,
            WarpOps {
                mma: 1,
                shfl: 1,
                vote: 1,
                bar: 1
            }
        );
        assert_eq!((f[1].name.as_str(), f[1].ops.bar), ("helper", 1));
        let tsv = "k\t1\t1\t1\t1\nbroken\n";
        assert_eq!(warp_ops_from_tsv(tsv), vec![f[0].clone()]);
    }
}
