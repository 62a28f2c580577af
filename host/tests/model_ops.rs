//! Dense model ops (`ModelOps`) on the cpu and emu backends: against naive f64 references
//! on random inputs (odd sizes, strided views, outputs poisoned with NaN first), bit-exact
//! batch invariance (a row alone, inside batches of many sizes, split into chunks, on
//! different thread counts), and typed errors that leave outputs untouched. Also rope
//! followed by its inverse (`inverse_rope_table`), and DeepSeek-V4's compressor pooling
//! (`gated_pool`: ragged windows with empty slots, non-finite inputs).
//!
//! Seeds are fresh each run and printed; `SPARSEKIT_SEED=N` replays one.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sparsekit_host::cpu::{CpuBuffer, CpuIsa};
use sparsekit_host::model_ops::{
    inverse_rope_table, rope_table, Accumulate, Add, Argmax, Cast, DenseDtype, Embed, GatedPool,
    GatherRows, Matmul, ModelOps, RmsNorm, Rope, SwiGlu, View,
};
use sparsekit_host::{Backend, CpuBackend, EmuBackend, Error};

const U: f64 = f32::EPSILON as f64 / 2.0;

fn rng(test: &str) -> ChaCha8Rng {
    let seed: u64 = std::env::var("SPARSEKIT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("{test}: seed {seed} (replay with SPARSEKIT_SEED={seed})");
    ChaCha8Rng::seed_from_u64(seed)
}

fn randn(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let v: f32 = rng.gen_range(-2.0..2.0);
            if v == 0.0 {
                0.5
            } else {
                v
            }
        })
        .collect()
}

fn buf(v: &[f32]) -> CpuBuffer {
    CpuBuffer::from_bytes(bytemuck::cast_slice(v))
}

fn poisoned(elems: usize) -> CpuBuffer {
    buf(&vec![f32::NAN; elems])
}

fn f32s(b: &CpuBuffer) -> Vec<f32> {
    b.typed::<f32>("t").unwrap().to_vec()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Backends under test: cpu on rayon's pool, cpu on 1 and 3 threads, emu, and cpu on each
/// other vector path this machine runs.
type MakeBackend = Box<dyn Fn() -> Box<dyn DenseBackend>>;

fn backends() -> Vec<(&'static str, MakeBackend)> {
    let mut v: Vec<(&'static str, MakeBackend)> = vec![
        ("cpu", Box::new(|| Box::new(CpuBackend::new()))),
        (
            "cpu1",
            Box::new(|| Box::new(CpuBackend::with_threads(1).unwrap())),
        ),
        (
            "cpu3",
            Box::new(|| Box::new(CpuBackend::with_threads(3).unwrap())),
        ),
        ("emu", Box::new(|| Box::new(EmuBackend::new()))),
    ];
    let default = CpuBackend::new().isa();
    for isa in CpuIsa::available().into_iter().map(|i| i.isa()) {
        if isa != default {
            v.push((
                isa.name(),
                Box::new(move || Box::new(CpuBackend::with_isa(isa).unwrap())),
            ));
        }
    }
    v
}

/// Object-safe slice of `ModelOps` over `CpuBuffer` so one test body covers every backend.
trait DenseBackend {
    fn matmul(
        &self,
        op: &Matmul,
        x: &CpuBuffer,
        w: &CpuBuffer,
        o: &mut CpuBuffer,
    ) -> Result<(), Error>;
    fn rms_norm(
        &self,
        op: &RmsNorm,
        x: &CpuBuffer,
        g: &CpuBuffer,
        o: &mut CpuBuffer,
    ) -> Result<(), Error>;
    fn rope(
        &self,
        op: &Rope<'_>,
        t: &CpuBuffer,
        x: &CpuBuffer,
        o: &mut CpuBuffer,
    ) -> Result<(), Error>;
    fn swiglu(&self, op: &SwiGlu, x: &CpuBuffer, o: &mut CpuBuffer) -> Result<(), Error>;
    fn embed(&self, op: &Embed<'_>, t: &CpuBuffer, o: &mut CpuBuffer) -> Result<(), Error>;
    fn gather_rows(
        &self,
        op: &GatherRows<'_>,
        x: &CpuBuffer,
        o: &mut CpuBuffer,
    ) -> Result<(), Error>;
    fn add(&self, op: &Add, x: &CpuBuffer, o: &mut CpuBuffer) -> Result<(), Error>;
    fn cast(&self, op: &Cast, x: &CpuBuffer, o: &mut CpuBuffer) -> Result<(), Error>;
    fn argmax(&self, op: &Argmax, x: &CpuBuffer, o: &mut CpuBuffer) -> Result<(), Error>;
    fn gated_pool(
        &self,
        op: &GatedPool<'_>,
        x: &CpuBuffer,
        bias: &CpuBuffer,
        o: &mut CpuBuffer,
    ) -> Result<(), Error>;
}

impl<B: ModelOps + Backend<Buffer = CpuBuffer>> DenseBackend for B {
    fn matmul(
        &self,
        op: &Matmul,
        x: &CpuBuffer,
        w: &CpuBuffer,
        o: &mut CpuBuffer,
    ) -> Result<(), Error> {
        ModelOps::matmul(self, op, x, w, o)
    }
    fn rms_norm(
        &self,
        op: &RmsNorm,
        x: &CpuBuffer,
        g: &CpuBuffer,
        o: &mut CpuBuffer,
    ) -> Result<(), Error> {
        ModelOps::rms_norm(self, op, x, g, o)
    }
    fn rope(
        &self,
        op: &Rope<'_>,
        t: &CpuBuffer,
        x: &CpuBuffer,
        o: &mut CpuBuffer,
    ) -> Result<(), Error> {
        ModelOps::rope(self, op, t, x, o)
    }
    fn swiglu(&self, op: &SwiGlu, x: &CpuBuffer, o: &mut CpuBuffer) -> Result<(), Error> {
        ModelOps::swiglu(self, op, x, o)
    }
    fn embed(&self, op: &Embed<'_>, t: &CpuBuffer, o: &mut CpuBuffer) -> Result<(), Error> {
        ModelOps::embed(self, op, t, o)
    }
    fn gather_rows(
        &self,
        op: &GatherRows<'_>,
        x: &CpuBuffer,
        o: &mut CpuBuffer,
    ) -> Result<(), Error> {
        ModelOps::gather_rows(self, op, x, o)
    }
    fn add(&self, op: &Add, x: &CpuBuffer, o: &mut CpuBuffer) -> Result<(), Error> {
        ModelOps::add(self, op, x, o)
    }
    fn cast(&self, op: &Cast, x: &CpuBuffer, o: &mut CpuBuffer) -> Result<(), Error> {
        ModelOps::cast(self, op, x, o)
    }
    fn argmax(&self, op: &Argmax, x: &CpuBuffer, o: &mut CpuBuffer) -> Result<(), Error> {
        ModelOps::argmax(self, op, x, o)
    }
    fn gated_pool(
        &self,
        op: &GatedPool<'_>,
        x: &CpuBuffer,
        bias: &CpuBuffer,
        o: &mut CpuBuffer,
    ) -> Result<(), Error> {
        ModelOps::gated_pool(self, op, x, bias, o)
    }
}

/// f64 reference of a (grouped, strided) matmul plus the rigorous error bound of a
/// sequential FMA chain: `|err| ≤ γ_k · Σ|x·w|` (+ the init's own magnitude).
fn matmul_ref(op: &Matmul, x: &[f32], w: &[f32], init: &[f32]) -> Vec<(usize, f64, f64)> {
    let mut r = Vec::new();
    for row in 0..op.rows {
        for g in 0..op.groups {
            for j in 0..op.n {
                let o = op.out.offset + row * op.out.row_stride + g * op.out.group_stride + j;
                let base = match op.accumulate {
                    Accumulate::Overwrite => 0.0,
                    Accumulate::Add => init[o] as f64,
                };
                let (mut s, mut mag) = (base, base.abs());
                for p in 0..op.k {
                    let xv = x[op.x.offset + row * op.x.row_stride + g * op.x.group_stride + p];
                    let t = xv as f64 * w[g * op.k * op.n + p * op.n + j] as f64;
                    s += t;
                    mag += t.abs();
                }
                let k = op.k as f64 + 1.0;
                r.push((o, s, k * U / (1.0 - k * U) * mag + 1e-38));
            }
        }
    }
    r
}

#[test]
fn matmul_matches_f64_reference() {
    let mut rng = rng("matmul_matches_f64_reference");
    for (name, make) in backends() {
        let b = make();
        // Plain, odd sizes on both paths (row split from 128 rows per worker, for narrow
        // outputs, or for weights of at most 2 MiB from 8 rows per worker; column split
        // otherwise: narrow blocks under 48 rows, wider above).
        for &(rows, k, n) in &[
            (1, 7, 129),
            (5, 33, 200),
            (4, 64, 640),
            (61, 17, 19),
            (100, 130, 70),
            (33, 20, 1100),
            (70, 300, 1100),
            (49, 520, 1040),
            (520, 9, 300),
        ] {
            let mut op = Matmul::dense(rows, k, n);
            let x = randn(&mut rng, rows * k);
            let w = randn(&mut rng, k * n);
            let mut out = poisoned(rows * n);
            b.matmul(&op, &buf(&x), &buf(&w), &mut out).unwrap();
            let got = f32s(&out);
            for (o, want, tol) in matmul_ref(&op, &x, &w, &[]) {
                let err = (got[o] as f64 - want).abs();
                assert!(
                    err <= tol,
                    "{name} {rows}x{k}x{n} [{o}]: {} vs {want} (tol {tol})",
                    got[o]
                );
            }
            // Accumulate into existing values.
            op.accumulate = Accumulate::Add;
            let init = randn(&mut rng, rows * n);
            let mut out = buf(&init);
            b.matmul(&op, &buf(&x), &buf(&w), &mut out).unwrap();
            let got = f32s(&out);
            for (o, want, tol) in matmul_ref(&op, &x, &w, &init) {
                assert!((got[o] as f64 - want).abs() <= tol, "{name} acc [{o}]");
            }
        }
        // Grouped with strided input and output views (per-head projections).
        for &(rows, groups, k, n) in &[(3, 4, 12, 40), (50, 3, 9, 33), (6, 16, 32, 144)] {
            let x_view = View {
                offset: 5,
                row_stride: groups * (k + 3) + 2,
                group_stride: k + 3,
            };
            let out_view = View {
                offset: 7,
                row_stride: groups * (n + 5) + 1,
                group_stride: n + 5,
            };
            let op = Matmul {
                rows,
                groups,
                k,
                n,
                x: x_view,
                out: out_view,
                accumulate: Accumulate::Overwrite,
            };
            let x = randn(&mut rng, 5 + rows * x_view.row_stride);
            let w = randn(&mut rng, groups * k * n);
            let total = 7 + rows * out_view.row_stride + 3;
            let mut out = poisoned(total);
            b.matmul(&op, &buf(&x), &buf(&w), &mut out).unwrap();
            let got = f32s(&out);
            let refs = matmul_ref(&op, &x, &w, &[]);
            let mut written = vec![false; total];
            for (o, want, tol) in refs {
                written[o] = true;
                assert!((got[o] as f64 - want).abs() <= tol, "{name} grouped [{o}]");
            }
            // Elements outside the view stay untouched (still NaN).
            for (i, w) in written.iter().enumerate() {
                if !w {
                    assert!(
                        got[i].is_nan(),
                        "{name}: element {i} outside the view written"
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_is_batch_invariant() {
    let mut rng = rng("matmul_is_batch_invariant");
    let (k, n) = (96, 300);
    let w = buf(&randn(&mut rng, k * n));
    let max_rows = 257;
    let x_all = randn(&mut rng, max_rows * k);
    let cpu = CpuBackend::new();
    // Each row alone.
    let alone: Vec<Vec<u32>> = (0..max_rows)
        .map(|r| {
            let mut out = poisoned(n);
            ModelOps::matmul(
                &cpu,
                &Matmul::dense(1, k, n),
                &buf(&x_all[r * k..(r + 1) * k]),
                &w,
                &mut out,
            )
            .unwrap();
            bits(&f32s(&out))
        })
        .collect();
    for (name, make) in backends() {
        let b = make();
        for &rows in &[1usize, 2, 3, 7, 47, 48, 49, 100, 257] {
            let mut out = poisoned(rows * n);
            b.matmul(
                &Matmul::dense(rows, k, n),
                &buf(&x_all[..rows * k]),
                &w,
                &mut out,
            )
            .unwrap();
            let got = bits(&f32s(&out));
            for r in 0..rows {
                assert_eq!(
                    &got[r * n..(r + 1) * n],
                    &alone[r][..],
                    "{name}: row {r} of {rows}"
                );
            }
        }
        // The same 257 rows as uneven chunks.
        let mut r0 = 0;
        for &c in [5usize, 60, 1, 100, 91].iter() {
            let mut out = poisoned(c * n);
            b.matmul(
                &Matmul::dense(c, k, n),
                &buf(&x_all[r0 * k..(r0 + c) * k]),
                &w,
                &mut out,
            )
            .unwrap();
            let got = bits(&f32s(&out));
            for r in 0..c {
                assert_eq!(
                    &got[r * n..(r + 1) * n],
                    &alone[r0 + r][..],
                    "{name}: chunk row {}",
                    r0 + r
                );
            }
            r0 += c;
        }
        assert_eq!(r0, max_rows);
    }
}

#[test]
fn rms_norm_matches_reference_and_is_batch_invariant() {
    let mut rng = rng("rms_norm");
    for (name, make) in backends() {
        let b = make();
        for &(rows, width) in &[(1, 5), (7, 33), (40, 256), (9, 1000)] {
            let stride = width + 3;
            let x = randn(&mut rng, rows * stride);
            let gamma = randn(&mut rng, width);
            let op = RmsNorm {
                rows,
                width,
                eps: 1e-6,
                x: View::cols(stride, 2),
                out: View::dense(width),
            };
            let mut out = poisoned(rows * width);
            b.rms_norm(&op, &buf(&x), &buf(&gamma), &mut out).unwrap();
            let got = f32s(&out);
            for r in 0..rows {
                let xr = &x[2 + r * stride..][..width];
                let ms: f64 = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / width as f64;
                let inv = 1.0 / (ms + 1e-6).sqrt();
                for c in 0..width {
                    let want = xr[c] as f64 * inv * gamma[c] as f64;
                    let tol = (width as f64 + 8.0) * U * want.abs() + 1e-30;
                    let g = got[r * width + c] as f64;
                    assert!(
                        (g - want).abs() <= tol,
                        "{name} rms r{r} c{c}: {g} vs {want}"
                    );
                }
                // Row alone gives the same bits.
                let one = RmsNorm {
                    rows: 1,
                    x: View::cols(stride, 2 + r * stride),
                    ..op
                };
                let mut o1 = poisoned(width);
                b.rms_norm(&one, &buf(&x), &buf(&gamma), &mut o1).unwrap();
                assert_eq!(
                    bits(&f32s(&o1)),
                    bits(&got[r * width..(r + 1) * width]),
                    "{name} rms alone r{r}"
                );
            }
        }
    }
}

#[test]
fn rope_matches_reference() {
    let mut rng = rng("rope");
    let (rope_dim, max_pos) = (32, 5000);
    let table = rope_table(rope_dim, max_pos, 10000.0);
    for (name, make) in backends() {
        let b = make();
        for &(rows, heads) in &[(1, 1), (6, 16), (37, 3)] {
            let head_stride = 64;
            let x_view = View {
                offset: 32,
                row_stride: heads * head_stride,
                group_stride: head_stride,
            };
            let out_view = View {
                offset: 1,
                row_stride: heads * 40,
                group_stride: 40,
            };
            let x = randn(&mut rng, rows * heads * head_stride);
            let positions: Vec<u32> = (0..rows)
                .map(|_| rng.gen_range(0..max_pos as u32))
                .collect();
            let op = Rope {
                heads,
                rope_dim,
                positions: &positions,
                max_positions: max_pos,
                x: x_view,
                out: out_view,
            };
            let mut out = poisoned(1 + rows * heads * 40);
            b.rope(&op, &buf(&table), &buf(&x), &mut out).unwrap();
            let got = f32s(&out);
            let h = rope_dim / 2;
            for r in 0..rows {
                for g in 0..heads {
                    let xi = &x[32 + r * heads * head_stride + g * head_stride..];
                    let o = &got[1 + r * heads * 40 + g * 40..];
                    // Independent angle in f64 (the table is checked too).
                    for i in 0..h {
                        let theta =
                            positions[r] as f64 * 10000f64.powf(-2.0 * i as f64 / rope_dim as f64);
                        let (c, s) = (theta.cos(), theta.sin());
                        let (a, bb) = (xi[i] as f64, xi[i + h] as f64);
                        let want = [a * c - bb * s, a * s + bb * c];
                        let tol = 4.0 * U * (a.abs() + bb.abs()) + 1e-30;
                        for (j, w) in want.iter().enumerate() {
                            let g_ = o[i + j * h] as f64;
                            assert!(
                                (g_ - w).abs() <= tol,
                                "{name} rope r{r} g{g} i{i}: {g_} vs {w}"
                            );
                        }
                    }
                    assert!(
                        o[rope_dim..40].iter().all(|v| v.is_nan()),
                        "{name}: rope wrote past its width"
                    );
                }
            }
        }
        // A position beyond the table is a typed error and writes nothing.
        let positions = [0u32, max_pos as u32];
        let op = Rope {
            heads: 1,
            rope_dim,
            positions: &positions,
            max_positions: max_pos,
            x: View::dense(rope_dim),
            out: View::dense(rope_dim),
        };
        let mut out = poisoned(2 * rope_dim);
        let err = b.rope(
            &op,
            &buf(&table),
            &buf(&randn(&mut rng, 2 * rope_dim)),
            &mut out,
        );
        assert!(
            matches!(err, Err(Error::InvalidArgument { .. })),
            "{name}: {err:?}"
        );
        assert!(f32s(&out).iter().all(|v| v.is_nan()));
    }
}

#[test]
fn swiglu_embed_gather_add_match_reference() {
    let mut rng = rng("swiglu_embed_gather_add");
    for (name, make) in backends() {
        let b = make();
        let (rows, width) = (37, 45);
        let gu = randn(&mut rng, rows * 2 * width);
        let mut out = poisoned(rows * width);
        b.swiglu(&SwiGlu { rows, width }, &buf(&gu), &mut out)
            .unwrap();
        let got = f32s(&out);
        for r in 0..rows {
            for c in 0..width {
                let (g, u) = (
                    gu[r * 2 * width + c] as f64,
                    gu[r * 2 * width + width + c] as f64,
                );
                let want = g / (1.0 + (-g).exp()) * u;
                let v = got[r * width + c] as f64;
                assert!(
                    (v - want).abs() <= 16.0 * U * want.abs() + 1e-30,
                    "{name} swiglu {r},{c}: {v} vs {want}"
                );
            }
        }

        let (vocab, dim) = (300, 24);
        let table = randn(&mut rng, vocab * dim);
        let tokens: Vec<u32> = (0..29).map(|_| rng.gen_range(0..vocab as u32)).collect();
        let mut out = poisoned(tokens.len() * dim);
        b.embed(
            &Embed {
                vocab,
                dim,
                tokens: &tokens,
            },
            &buf(&table),
            &mut out,
        )
        .unwrap();
        let got = f32s(&out);
        for (i, &t) in tokens.iter().enumerate() {
            assert_eq!(
                bits(&got[i * dim..(i + 1) * dim]),
                bits(&table[t as usize * dim..][..dim]),
                "{name} embed"
            );
        }
        let bad = [1u32, vocab as u32];
        let mut out = poisoned(2 * dim);
        assert!(b
            .embed(
                &Embed {
                    vocab,
                    dim,
                    tokens: &bad
                },
                &buf(&table),
                &mut out
            )
            .is_err());
        assert!(f32s(&out).iter().all(|v| v.is_nan()));

        let src_rows = 11;
        let x = randn(&mut rng, src_rows * 30);
        let pick = [10u32, 0, 3, 3];
        let op = GatherRows {
            width: 20,
            rows: &pick,
            src_rows,
            x: View::cols(30, 5),
            out: View::dense(20),
        };
        let mut out = poisoned(4 * 20);
        b.gather_rows(&op, &buf(&x), &mut out).unwrap();
        let got = f32s(&out);
        for (i, &r) in pick.iter().enumerate() {
            assert_eq!(
                bits(&got[i * 20..(i + 1) * 20]),
                bits(&x[5 + r as usize * 30..][..20])
            );
        }

        let a = randn(&mut rng, rows * width);
        let acc0 = randn(&mut rng, rows * width);
        let mut acc = buf(&acc0);
        b.add(
            &Add {
                rows,
                width,
                x: View::dense(width),
                acc: View::dense(width),
            },
            &buf(&a),
            &mut acc,
        )
        .unwrap();
        let got = f32s(&acc);
        for i in 0..rows * width {
            assert_eq!(got[i].to_bits(), (acc0[i] + a[i]).to_bits());
        }
    }
}

/// Round-to-nearest-even f32 → bf16 by integer arithmetic (independent of `half`).
fn bf16_rne(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x40;
    }
    let lsb = (b >> 16) & 1;
    ((b + 0x7fff + lsb) >> 16) as u16
}

#[test]
fn cast_and_argmax_are_exact() {
    let mut rng = rng("cast_and_argmax");
    for (name, make) in backends() {
        let b = make();
        let (rows, groups, width) = (9, 3, 21);
        let mut x = randn(&mut rng, rows * groups * width);
        x[4] = f32::NAN;
        x[5] = f32::INFINITY;
        x[6] = -0.0;
        x[7] = 1.0 + f32::EPSILON * 64.0; // exactly halfway between two bf16 values
        x[8] = 3.0e38;
        let op = Cast {
            rows,
            groups,
            width,
            from: DenseDtype::F32,
            to: DenseDtype::Bf16,
            x: View::grouped(groups, width),
            out: View::grouped(groups, 32),
        };
        let mut out = CpuBuffer::from_bytes(&vec![0xff; rows * groups * 32 * 2]);
        b.cast(&op, &buf(&x), &mut out).unwrap();
        let got: Vec<u16> = out.typed::<u16>("o").unwrap().to_vec();
        for r in 0..rows {
            for g in 0..groups {
                for c in 0..32 {
                    let v = got[r * groups * 32 + g * 32 + c];
                    if c < width {
                        let s = x[r * groups * width + g * width + c];
                        if s.is_nan() {
                            assert!(bf16::from_bits(v).is_nan(), "{name}: NaN lost");
                        } else {
                            assert_eq!(v, bf16_rne(s), "{name}: cast of {s}");
                        }
                    } else {
                        assert_eq!(v, 0xffff, "{name}: cast wrote past its width");
                    }
                }
            }
        }
        // And back: exact.
        let back = Cast {
            from: DenseDtype::Bf16,
            to: DenseDtype::F32,
            x: View::grouped(groups, 32),
            out: View::grouped(groups, width),
            ..op
        };
        let mut f = poisoned(rows * groups * width);
        b.cast(&back, &out, &mut f).unwrap();
        for (i, v) in f32s(&f).iter().enumerate() {
            let (r, rem) = (i / (groups * width), i % (groups * width));
            let src = got[r * groups * 32 + (rem / width) * 32 + rem % width];
            assert_eq!(v.to_bits(), (src as u32) << 16, "{name}: bf16 → f32");
        }

        // Argmax: ties to the lowest column, NaN wins, -inf rows pick column 0.
        let width = 37;
        let mut l = randn(&mut rng, 5 * width);
        l[width + 3] = 9.0;
        l[width + 30] = 9.0;
        l[2 * width + 20] = f32::NAN;
        l[2 * width + 21] = 100.0;
        for v in &mut l[3 * width..4 * width] {
            *v = f32::NEG_INFINITY;
        }
        let mut out = CpuBuffer::from_bytes(&[0xaa; 20]);
        b.argmax(&Argmax { rows: 5, width }, &buf(&l), &mut out)
            .unwrap();
        let got = out.typed::<u32>("o").unwrap().to_vec();
        let naive = |row: &[f32]| {
            let mut best = 0;
            for i in 0..row.len() {
                if row[i].is_nan() {
                    return i as u32;
                }
                if row[i] > row[best] {
                    best = i;
                }
            }
            best as u32
        };
        assert_eq!(got[1], 3, "{name}: tie");
        assert_eq!(got[2], 20, "{name}: NaN");
        assert_eq!(got[3], 0, "{name}: -inf row");
        for r in 0..5 {
            assert_eq!(
                got[r],
                naive(&l[r * width..(r + 1) * width]),
                "{name}: row {r}"
            );
        }
    }
}

#[test]
fn rejected_calls_write_nothing() {
    rejected_calls_write_nothing_on(&CpuBackend::new());
    rejected_calls_write_nothing_on(&EmuBackend::new());
}

fn rejected_calls_write_nothing_on<B: ModelOps<Buffer = CpuBuffer>>(b: &B) {
    let x = buf(&[1.0; 64]);
    let w = buf(&[1.0; 64]);
    let mut out = poisoned(64);
    // Weight of the wrong size.
    let e = ModelOps::matmul(b, &Matmul::dense(8, 8, 8), &x, &buf(&[1.0; 63]), &mut out);
    assert!(matches!(e, Err(Error::BufferSize { .. })), "{e:?}");
    // Output too small.
    let e = ModelOps::matmul(b, &Matmul::dense(9, 8, 8), &buf(&[1.0; 72]), &w, &mut out);
    assert!(matches!(e, Err(Error::Shape { .. })), "{e:?}");
    // Overlapping output rows.
    let mut op = Matmul::dense(4, 8, 8);
    op.out.row_stride = 4;
    let e = ModelOps::matmul(b, &op, &x, &w, &mut out);
    assert!(matches!(e, Err(Error::InvalidArgument { .. })), "{e:?}");
    // Input rows overlapping (stride < k) are rejected too.
    let mut op = Matmul::dense(4, 8, 8);
    op.x.row_stride = 2;
    assert!(ModelOps::matmul(b, &op, &x, &w, &mut out).is_err());
    // A buffer that is not a whole number of f32.
    let odd = CpuBuffer::from_bytes(&[0u8; 255]);
    assert!(ModelOps::matmul(b, &Matmul::dense(8, 8, 8), &odd, &w, &mut out).is_err());
    // Norm with eps 0 and gamma of the wrong size.
    let op = RmsNorm {
        rows: 8,
        width: 8,
        eps: 0.0,
        x: View::dense(8),
        out: View::dense(8),
    };
    assert!(ModelOps::rms_norm(b, &op, &x, &buf(&[1.0; 8]), &mut out).is_err());
    let op = RmsNorm { eps: 1e-6, ..op };
    assert!(ModelOps::rms_norm(b, &op, &x, &buf(&[1.0; 7]), &mut out).is_err());
    assert!(ModelOps::swiglu(b, &SwiGlu { rows: 8, width: 5 }, &x, &mut out).is_err());
    assert!(ModelOps::argmax(b, &Argmax { rows: 2, width: 0 }, &x, &mut out).is_err());
    let pick = [0u32, 9];
    let op = GatherRows {
        width: 4,
        rows: &pick,
        src_rows: 8,
        x: View::dense(8),
        out: View::dense(4),
    };
    assert!(ModelOps::gather_rows(b, &op, &x, &mut out).is_err());
    assert!(
        f32s(&out).iter().all(|v| v.is_nan()),
        "a rejected call wrote"
    );
    gated_pool_rejections(b);
}

/// The GPU dense kernels (run by the emulator) give the CPU backend's bits for every op,
/// on every vector path of the CPU backend this machine runs: the same operation sequence
/// per element, so a model's outputs agree across backends and paths. Inputs include
/// extreme and non-finite values where the op is defined on them.
#[test]
fn gpu_kernels_give_the_cpu_bits() {
    let mut rng = rng("gpu_kernels_give_the_cpu_bits");
    for isa in CpuIsa::available() {
        let cpu = CpuBackend::with_isa(isa.isa()).unwrap();
        gpu_kernels_give_the_cpu_bits_on(&cpu, &mut rng);
    }
}

fn gpu_kernels_give_the_cpu_bits_on(cpu: &CpuBackend, rng: &mut ChaCha8Rng) {
    let emu = EmuBackend::new();
    let isa = cpu.isa().name();
    let same = |what: &str, a: &CpuBuffer, b: &CpuBuffer| {
        assert_eq!(a.bytes(), b.bytes(), "{what}: emu differs from cpu ({isa})");
    };
    // Matmul: tiles cut mid-way in rows and columns, k across several staged chunks,
    // grouped strided views, both accumulate modes.
    for &(rows, groups, k, n) in &[(13, 1, 300, 130), (9, 3, 129, 257), (1, 2, 5, 1)] {
        let xv = View {
            offset: 3,
            row_stride: groups * (k + 1) + 2,
            group_stride: k + 1,
        };
        let ov = View {
            offset: 1,
            row_stride: groups * (n + 2),
            group_stride: n + 2,
        };
        let x = buf(&randn(rng, 3 + rows * xv.row_stride));
        let w = buf(&randn(rng, groups * k * n));
        let init = randn(rng, 1 + rows * ov.row_stride);
        for accumulate in [Accumulate::Overwrite, Accumulate::Add] {
            let op = Matmul {
                rows,
                groups,
                k,
                n,
                x: xv,
                out: ov,
                accumulate,
            };
            let (mut a, mut b) = (buf(&init), buf(&init));
            ModelOps::matmul(cpu, &op, &x, &w, &mut a).unwrap();
            ModelOps::matmul(&emu, &op, &x, &w, &mut b).unwrap();
            same("matmul", &a, &b);
        }
    }
    // RMSNorm over widths below, at and above the 16 lanes, huge values included.
    for &(rows, width) in &[(6, 7), (5, 16), (3, 1001)] {
        let mut xs = randn(rng, rows * width);
        xs[1] = 3.0e19;
        let x = buf(&xs);
        let gamma = buf(&randn(rng, width));
        let op = RmsNorm {
            rows,
            width,
            eps: 1e-6,
            x: View::dense(width),
            out: View::dense(width),
        };
        let (mut a, mut b) = (poisoned(rows * width), poisoned(rows * width));
        ModelOps::rms_norm(cpu, &op, &x, &gamma, &mut a).unwrap();
        ModelOps::rms_norm(&emu, &op, &x, &gamma, &mut b).unwrap();
        same("rms_norm", &a, &b);
    }
    // Rope on grouped views.
    let (heads, rope_dim, max_pos) = (3, 10, 64);
    let table = buf(&rope_table(rope_dim, max_pos, 10000.0));
    let positions: Vec<u32> = (0..7).map(|_| rng.gen_range(0..max_pos as u32)).collect();
    let v = View::grouped(heads, rope_dim + 2);
    let x = buf(&randn(rng, 7 * heads * (rope_dim + 2)));
    let op = Rope {
        heads,
        rope_dim,
        positions: &positions,
        max_positions: max_pos,
        x: v,
        out: View::grouped(heads, rope_dim),
    };
    let (mut a, mut b) = (
        poisoned(7 * heads * rope_dim),
        poisoned(7 * heads * rope_dim),
    );
    ModelOps::rope(cpu, &op, &table, &x, &mut a).unwrap();
    ModelOps::rope(&emu, &op, &table, &x, &mut b).unwrap();
    same("rope", &a, &b);
    // SwiGLU with gates across exp's whole range (under- and overflow, NaN, ±inf).
    let (rows, width) = (5, 67);
    let mut gu: Vec<f32> = (0..rows * 2 * width)
        .map(|_| rng.gen_range(-120.0f32..120.0))
        .collect();
    gu[0] = f32::NAN;
    gu[1] = f32::INFINITY;
    gu[2] = f32::NEG_INFINITY;
    gu[3] = -0.0;
    let op = SwiGlu { rows, width };
    let (mut a, mut b) = (poisoned(rows * width), poisoned(rows * width));
    ModelOps::swiglu(cpu, &op, &buf(&gu), &mut a).unwrap();
    ModelOps::swiglu(&emu, &op, &buf(&gu), &mut b).unwrap();
    same("swiglu", &a, &b);
    // Embedding and row gathers.
    let (vocab, dim) = (50, 19);
    let table = buf(&randn(rng, vocab * dim));
    let tokens: Vec<u32> = (0..11).map(|_| rng.gen_range(0..vocab as u32)).collect();
    let op = Embed {
        vocab,
        dim,
        tokens: &tokens,
    };
    let (mut a, mut b) = (poisoned(11 * dim), poisoned(11 * dim));
    ModelOps::embed(cpu, &op, &table, &mut a).unwrap();
    ModelOps::embed(&emu, &op, &table, &mut b).unwrap();
    same("embed", &a, &b);
    let op = GatherRows {
        width: dim - 2,
        rows: &tokens,
        src_rows: vocab,
        x: View::cols(dim, 1),
        out: View::cols(dim, 0),
    };
    let (mut a, mut b) = (poisoned(11 * dim), poisoned(11 * dim));
    ModelOps::gather_rows(cpu, &op, &table, &mut a).unwrap();
    ModelOps::gather_rows(&emu, &op, &table, &mut b).unwrap();
    same("gather_rows", &a, &b);
    // Residual add into a strided accumulator.
    let x = buf(&randn(rng, 8 * 40));
    let init = randn(rng, 8 * 45);
    let op = Add {
        rows: 8,
        width: 40,
        x: View::dense(40),
        acc: View::cols(45, 3),
    };
    let (mut a, mut b) = (buf(&init), buf(&init));
    ModelOps::add(cpu, &op, &x, &mut a).unwrap();
    ModelOps::add(&emu, &op, &x, &mut b).unwrap();
    same("add", &a, &b);
    // Casts both ways, NaN payloads and rounding ties included.
    let mut xs = randn(rng, 4 * 2 * 33);
    xs[0] = f32::from_bits(0x7fc1_2345);
    xs[1] = f32::from_bits(0xff80_0001);
    xs[2] = 1.0 + f32::EPSILON * 64.0;
    xs[3] = f32::MAX;
    let op = Cast {
        rows: 4,
        groups: 2,
        width: 33,
        from: DenseDtype::F32,
        to: DenseDtype::Bf16,
        x: View::grouped(2, 33),
        out: View::grouped(2, 33),
    };
    let (mut a, mut b) = (
        CpuBuffer::from_bytes(&[0xee; 4 * 2 * 33 * 2]),
        CpuBuffer::from_bytes(&[0xee; 4 * 2 * 33 * 2]),
    );
    ModelOps::cast(cpu, &op, &buf(&xs), &mut a).unwrap();
    ModelOps::cast(&emu, &op, &buf(&xs), &mut b).unwrap();
    same("cast f32→bf16", &a, &b);
    let back = Cast {
        from: DenseDtype::Bf16,
        to: DenseDtype::F32,
        ..op
    };
    let (mut c, mut d) = (poisoned(4 * 2 * 33), poisoned(4 * 2 * 33));
    ModelOps::cast(cpu, &back, &a, &mut c).unwrap();
    ModelOps::cast(&emu, &back, &a, &mut d).unwrap();
    same("cast bf16→f32", &c, &d);
    // Argmax over rows wider than a warp: ties across lanes, NaNs in several lanes.
    let width = 1000;
    let mut l = randn(rng, 6 * width);
    l[5] = 7.0;
    l[700] = 7.0;
    l[width + 900] = f32::NAN;
    l[width + 33] = f32::NAN;
    l[2 * width + 64] = f32::INFINITY;
    l[3 * width + 10] = -0.0;
    for v in &mut l[4 * width..5 * width] {
        *v = f32::NEG_INFINITY;
    }
    let op = Argmax { rows: 6, width };
    let (mut a, mut b) = (
        CpuBuffer::from_bytes(&[0xaa; 24]),
        CpuBuffer::from_bytes(&[0xaa; 24]),
    );
    ModelOps::argmax(cpu, &op, &buf(&l), &mut a).unwrap();
    ModelOps::argmax(&emu, &op, &buf(&l), &mut b).unwrap();
    same("argmax", &a, &b);
    let got = b.typed::<u32>("o").unwrap().to_vec();
    assert_eq!((got[0], got[1], got[2]), (5, 33, 64));
}

/// `u·k / (1 − u·k)`: the relative error bound of `k` rounded operations in a chain.
fn gamma(k: usize) -> f64 {
    let k = k as f64;
    k * U / (1.0 - k * U)
}

/// Rope with [`rope_table`] and then with [`inverse_rope_table`] at the same positions
/// gives back the input. Bound per element `x_j` of a pair `(a, b)`: the tables' `c̃, s̃`
/// have `c̃² + s̃² = 1 + ε`, `|ε| ≤ 2u(1 + u)`; each rope step adds at most
/// `γ₂·(|c̃·a| + |s̃·b|)` per element, and the forward error passes the inverse's rotation
/// (norm ≤ √2 on a component); so
/// `|x' − x| ≤ 2u(1+u)|x_j| + 2√2·γ₂·(1 + 2u)·(|a| + |b|)`. The inverse alone is also
/// checked against the f64 rotation by `−θ`.
#[test]
fn rope_then_inverse_rope_returns_the_input() {
    let mut rng = rng("rope_then_inverse_rope");
    let (rope_dim, max_pos) = (64, 3000);
    let fwd = buf(&rope_table(rope_dim, max_pos, 10000.0));
    let inv = buf(&inverse_rope_table(rope_dim, max_pos, 10000.0));
    let h = rope_dim / 2;
    for (name, make) in backends() {
        let b = make();
        for &(rows, heads) in &[(1usize, 1usize), (7, 3), (33, 2)] {
            let x: Vec<f32> = randn(&mut rng, rows * heads * rope_dim)
                .into_iter()
                .map(|v| v * 40.0)
                .collect();
            let positions: Vec<u32> = (0..rows)
                .map(|_| rng.gen_range(0..max_pos as u32))
                .collect();
            let op = Rope {
                heads,
                rope_dim,
                positions: &positions,
                max_positions: max_pos,
                x: View::grouped(heads, rope_dim),
                out: View::grouped(heads, rope_dim),
            };
            let n = rows * heads * rope_dim;
            let (mut y, mut back, mut only_inv) = (poisoned(n), poisoned(n), poisoned(n));
            b.rope(&op, &fwd, &buf(&x), &mut y).unwrap();
            b.rope(&op, &inv, &y, &mut back).unwrap();
            b.rope(&op, &inv, &buf(&x), &mut only_inv).unwrap();
            let (back, only_inv) = (f32s(&back), f32s(&only_inv));
            for (r, &pr) in positions.iter().enumerate().take(rows) {
                for g in 0..heads {
                    let o = (r * heads + g) * rope_dim;
                    for i in 0..h {
                        let (a, bb) = (x[o + i] as f64, x[o + i + h] as f64);
                        let pair = a.abs() + bb.abs();
                        for (j, xj) in [(i, a), (i + h, bb)] {
                            let tol = 2.0 * U * (1.0 + U) * xj.abs()
                                + 2.0 * 2f64.sqrt() * gamma(2) * (1.0 + 2.0 * U) * pair;
                            let got = back[o + j] as f64;
                            assert!(
                                (got - xj).abs() <= tol,
                                "{name} r{r} g{g} j{j}: {got} back vs {xj} (tol {tol})"
                            );
                        }
                        // The inverse alone: rotation by −θ.
                        let theta = pr as f64 * 10000f64.powf(-2.0 * i as f64 / rope_dim as f64);
                        let (c, sn) = (theta.cos(), theta.sin());
                        let want = [a * c + bb * sn, bb * c - a * sn];
                        let tol = 4.0 * U * pair + 1e-30;
                        for (k, w) in want.iter().enumerate() {
                            let got = only_inv[o + i + k * h] as f64;
                            assert!(
                                (got - w).abs() <= tol,
                                "{name} inverse r{r} g{g} i{i}: {got} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Random `[entries, span]` source ids with ragged valid-slot counts: by `e % 4`, every
/// slot valid; one valid slot in the middle; both ends valid and a hole in the middle;
/// a sparse random pattern (at least one valid slot). Ids repeat freely.
fn ragged_sources(rng: &mut ChaCha8Rng, entries: usize, span: usize, rows: usize) -> Vec<u32> {
    let mut s = Vec::with_capacity(entries * span);
    for e in 0..entries {
        let mut slots: Vec<u32> = (0..span).map(|_| rng.gen_range(0..rows as u32)).collect();
        match e % 4 {
            0 => {}
            1 => {
                for (i, v) in slots.iter_mut().enumerate() {
                    if i != span / 2 {
                        *v = GatedPool::EMPTY;
                    }
                }
            }
            2 => {
                for v in slots.iter_mut().take(span.saturating_sub(1)).skip(1) {
                    if rng.gen_bool(0.5) {
                        *v = GatedPool::EMPTY;
                    }
                }
                if span >= 3 {
                    slots[span / 2] = GatedPool::EMPTY;
                }
            }
            _ => {
                let keep = rng.gen_range(0..span);
                for (i, v) in slots.iter_mut().enumerate() {
                    if i != keep && rng.gen_bool(0.7) {
                        *v = GatedPool::EMPTY;
                    }
                }
            }
        }
        s.extend(slots);
    }
    s
}

/// Random `[rows, 2·width]` x (values of magnitude ≤ 2, gate logits ≤ 2·gate_scale) and
/// `[span, width]` bias (≤ 2·gate_scale); no zeros.
fn gated_pool_inputs(
    rng: &mut ChaCha8Rng,
    rows: usize,
    span: usize,
    width: usize,
    gate_scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let mut x = randn(rng, rows * 2 * width);
    for r in 0..rows {
        for v in &mut x[r * 2 * width + width..(r + 1) * 2 * width] {
            *v *= gate_scale;
        }
    }
    let bias = randn(rng, span * width)
        .into_iter()
        .map(|v| v * gate_scale)
        .collect();
    (x, bias)
}

/// The f64 reference of one output `(e, c)` of a gated pool and its error bound.
///
/// With `z_i = g + bias` exact in f64, `m = max z_i`, `w_i = exp(z_i − m)`, `S = Σ w_i`,
/// `N = Σ w_i·v_i` and `A = Σ w_i·|v_i| / S` (≥ |N/S|): the backend's `z_i − m` differs
/// from the exact one by at most `δ_i = u(|z_i| + |m| + |z_i − m|)(1 + 2u)` (rounding of
/// `z_i`, of `m`, which is a rounded `z`, and of the subtraction), `exp_portable` adds
/// 2 ulp (≤ 4u relative), so each weight is off by a relative `η ≤ e^δ·(1 + 4u) − 1`.
/// The sequential sums over `n` valid slots add `γ(n−1)` (weights) and `γ(n)` (products
/// and sums), so `Ñ = N + ΔN`, `|ΔN| ≤ A·S·ε_N` with `ε_N = (1+η)(1+γ(n)) − 1`, and
/// `S̃ = S(1 + ε_S)`, `|ε_S| ≤ (1+η)(1+γ(n−1)) − 1`; the division adds `u`:
/// `|out − N/S| ≤ A·(ε_N + ε_S + u(1 + ε_N)) / (1 − ε_S)`, plus `n·(max|v| + 1)·2⁻¹⁴⁶`
/// for weights and products in the subnormal range (`S ≥ 1`).
fn gated_pool_ref(op: &GatedPool<'_>, x: &[f32], bias: &[f32], e: usize, c: usize) -> (f64, f64) {
    let w = op.width;
    let slots: Vec<(usize, usize)> = op.sources[e * op.span..(e + 1) * op.span]
        .iter()
        .enumerate()
        .filter(|(_, &s)| s != GatedPool::EMPTY)
        .map(|(i, &s)| (i, s as usize))
        .collect();
    let zv: Vec<(f64, f64)> = slots
        .iter()
        .map(|&(i, s)| {
            (
                x[s * 2 * w + w + c] as f64 + bias[i * w + c] as f64,
                x[s * 2 * w + c] as f64,
            )
        })
        .collect();
    let m = zv.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
    let (mut sum, mut num, mut mag, mut vmax, mut delta) = (0f64, 0f64, 0f64, 0f64, 0f64);
    for &(z, v) in &zv {
        let wt = (z - m).exp();
        sum += wt;
        num += wt * v;
        mag += wt * v.abs();
        vmax = vmax.max(v.abs());
        delta = delta.max(U * (z.abs() + m.abs() + (z - m).abs()) * (1.0 + 2.0 * U));
    }
    let n = zv.len();
    let eta = delta.exp() * (1.0 + 4.0 * U) - 1.0;
    let eps_n = (1.0 + eta) * (1.0 + gamma(n)) - 1.0;
    let eps_s = (1.0 + eta) * (1.0 + gamma(n.saturating_sub(1))) - 1.0;
    let a = mag / sum;
    let tol = a * (eps_n + eps_s + U * (1.0 + eps_n)) / (1.0 - eps_s)
        + n as f64 * (vmax + 1.0) * 2f64.powi(-146);
    (num / sum, tol)
}

#[test]
fn gated_pool_matches_f64_reference() {
    let mut rng = rng("gated_pool_matches_f64_reference");
    for (name, make) in backends() {
        let b = make();
        // (entries, span, width, rows, gate scale): odd sizes, V4's CSA window (8) and a
        // long HCA-like window (128), widths below and above a warp; gate scale 30 spreads
        // the logits so that many weights underflow to 0.
        for &(entries, span, width, rows, scale) in &[
            (1usize, 1usize, 1usize, 1usize, 1.0f32),
            (7, 5, 37, 23, 1.0),
            (9, 8, 64, 40, 4.0),
            (6, 8, 33, 17, 30.0),
            (3, 128, 19, 150, 2.0),
            (11, 3, 300, 9, 1.0),
        ] {
            let sources = ragged_sources(&mut rng, entries, span, rows);
            let (x, bias) = gated_pool_inputs(&mut rng, rows, span, width, scale);
            let op = GatedPool {
                entries,
                span,
                width,
                sources: &sources,
                rows,
            };
            let mut out = poisoned(entries * width);
            b.gated_pool(&op, &buf(&x), &buf(&bias), &mut out).unwrap();
            let got = f32s(&out);
            for e in 0..entries {
                let slots = &sources[e * span..(e + 1) * span];
                let valid: Vec<usize> = (0..span)
                    .filter(|&i| slots[i] != GatedPool::EMPTY)
                    .collect();
                for c in 0..width {
                    let g = got[e * width + c];
                    assert!(g.is_finite(), "{name} e{e} c{c}: {g} (not written?)");
                    let (want, tol) = gated_pool_ref(&op, &x, &bias, e, c);
                    assert!(
                        (g as f64 - want).abs() <= tol,
                        "{name} {entries}x{span}x{width} e{e} c{c}: {g} vs {want} (tol {tol:e})"
                    );
                    // One valid slot: weight 1, sum 1: exactly the value.
                    if valid.len() == 1 {
                        let s = slots[valid[0]] as usize;
                        assert_eq!(
                            g.to_bits(),
                            x[s * 2 * width + c].to_bits(),
                            "{name} e{e} c{c}: single slot"
                        );
                    }
                }
            }
        }
    }
}

/// An entry's outputs are the same bits alone, in the whole batch, or in chunks of it.
#[test]
fn gated_pool_is_batch_invariant() {
    let mut rng = rng("gated_pool_is_batch_invariant");
    let (entries, span, width, rows) = (13, 8, 45, 31);
    let sources = ragged_sources(&mut rng, entries, span, rows);
    let (x, bias) = gated_pool_inputs(&mut rng, rows, span, width, 6.0);
    let (x, bias) = (buf(&x), buf(&bias));
    for (name, make) in backends() {
        let b = make();
        let run = |e0: usize, n: usize| {
            let op = GatedPool {
                entries: n,
                span,
                width,
                sources: &sources[e0 * span..(e0 + n) * span],
                rows,
            };
            let mut out = poisoned(n * width);
            b.gated_pool(&op, &x, &bias, &mut out).unwrap();
            bits(&f32s(&out))
        };
        let all = run(0, entries);
        for e in 0..entries {
            assert_eq!(
                run(e, 1),
                all[e * width..(e + 1) * width],
                "{name}: entry {e} alone"
            );
        }
        let mut e0 = 0;
        for n in [3usize, 1, 5, 4] {
            assert_eq!(
                run(e0, n),
                all[e0 * width..(e0 + n) * width],
                "{name}: chunk at {e0}"
            );
            e0 += n;
        }
        assert_eq!(e0, entries);
    }
}

/// Non-finite inputs, as `GatedPool`'s docs say: NaN in a valid slot's value, logit or
/// bias makes that output NaN (only that one); a `+inf` logit gives NaN; a `−inf` logit
/// drops its slot exactly (the same bits as the slot left empty); all logits `−inf`
/// gives NaN; a `+inf` value with a positive weight gives `+inf`; NaN bias at a slot
/// every entry leaves empty changes nothing.
#[test]
fn gated_pool_non_finite_inputs_behave_as_documented() {
    let mut rng = rng("gated_pool_non_finite");
    let (span, width, rows) = (4, 9, 12);
    const E: u32 = GatedPool::EMPTY;
    // Rows 0..=7 one per case below; rows 8.. finite fillers.
    let sources: Vec<u32> = vec![
        0, 8, E, 9, // 0: NaN value (row 0, channel 1)
        1, 8, E, 9, // 1: NaN logit (row 1, channel 2)
        2, 8, E, 9, // 2: +inf logit (row 2, channel 3)
        3, 8, E, 9, // 3: −inf logit (row 3, channel 4) ...
        E, 8, E, 9, // 4: ... the same entry with that slot empty
        4, 5, E, E, // 5: every logit −inf at channel 5 (rows 4 and 5)
        6, 8, E, 9, // 6: +inf value (row 6, channel 6)
        7, 10, E, 11, // 7: finite; bias[2, :] is NaN but slot 2 is empty everywhere ...
        E, 7, E,
        E, // 8: ... and NaN bias[3, 7] reaches only entries using slot 3: 0..=4, 6, 7
    ];
    let entries = sources.len() / span;
    let (mut x, mut bias) = gated_pool_inputs(&mut rng, rows, span, width, 3.0);
    let v = |r: usize, c: usize| r * 2 * width + c;
    let g = |r: usize, c: usize| r * 2 * width + width + c;
    x[v(0, 1)] = f32::NAN;
    x[g(1, 2)] = f32::NAN;
    x[g(2, 3)] = f32::INFINITY;
    x[g(3, 4)] = f32::NEG_INFINITY;
    x[g(4, 5)] = f32::NEG_INFINITY;
    x[g(5, 5)] = f32::NEG_INFINITY;
    x[v(6, 6)] = f32::INFINITY;
    for c in 0..width {
        bias[2 * width + c] = f32::NAN;
    }
    bias[3 * width + 7] = f32::NAN;
    let op = GatedPool {
        entries,
        span,
        width,
        sources: &sources,
        rows,
    };
    let nan_at = |e: usize, c: usize| {
        matches!((e, c), (0, 1) | (1, 2) | (2, 3) | (5, 5))
            || (c == 7 && sources[e * span + 3] != E)
    };
    for (name, make) in backends() {
        let b = make();
        let mut out = poisoned(entries * width);
        b.gated_pool(&op, &buf(&x), &buf(&bias), &mut out).unwrap();
        let got = f32s(&out);
        for e in 0..entries {
            for c in 0..width {
                let o = got[e * width + c];
                if nan_at(e, c) {
                    assert!(o.is_nan(), "{name} e{e} c{c}: {o}, want NaN");
                } else if (e, c) == (6, 6) {
                    assert_eq!(o, f32::INFINITY, "{name}: +inf value");
                } else {
                    assert!(o.is_finite(), "{name} e{e} c{c}: {o}, want finite");
                }
            }
        }
        // The −inf logit's slot is dropped exactly.
        assert_eq!(
            got[3 * width + 4].to_bits(),
            got[4 * width + 4].to_bits(),
            "{name}: −inf logit vs empty slot"
        );
    }
}

/// The GPU kernel (on the emulator) gives the CPU backend's bits on ragged batches with
/// logits across exp's whole range (weights that underflow, logit sums that overflow),
/// and, with NaN and ±inf inputs, NaN exactly where the CPU has NaN (NaN payload bits
/// are not part of the contract) and the same bits elsewhere.
#[test]
fn gated_pool_gpu_kernel_gives_the_cpu_bits() {
    let mut rng = rng("gated_pool_gpu_kernel_gives_the_cpu_bits");
    let cpu = CpuBackend::new();
    let emu = EmuBackend::new();
    for &(entries, span, width, rows, scale, non_finite) in &[
        (10usize, 8usize, 70usize, 29usize, 1.0f32, false),
        (5, 128, 33, 200, 20.0, false),
        (9, 5, 41, 13, 60.0, true),
    ] {
        let sources = ragged_sources(&mut rng, entries, span, rows);
        let (mut x, mut bias) = gated_pool_inputs(&mut rng, rows, span, width, scale);
        if non_finite {
            let n = x.len();
            for (k, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3.0e38, -3.0e38]
                .into_iter()
                .cycle()
                .take(12)
                .enumerate()
            {
                let i = rng.gen_range(0..n);
                x[i] = v;
                if k % 3 == 0 {
                    let j = rng.gen_range(0..bias.len());
                    bias[j] = v;
                }
            }
        }
        let op = GatedPool {
            entries,
            span,
            width,
            sources: &sources,
            rows,
        };
        let (mut a, mut b) = (poisoned(entries * width), poisoned(entries * width));
        ModelOps::gated_pool(&cpu, &op, &buf(&x), &buf(&bias), &mut a).unwrap();
        ModelOps::gated_pool(&emu, &op, &buf(&x), &buf(&bias), &mut b).unwrap();
        // Every other vector path of the cpu backend: the same bytes.
        for isa in CpuIsa::available() {
            let other = CpuBackend::with_isa(isa.isa()).unwrap();
            let mut c = poisoned(entries * width);
            ModelOps::gated_pool(&other, &op, &buf(&x), &buf(&bias), &mut c).unwrap();
            assert_eq!(a.bytes(), c.bytes(), "gated_pool on {}", isa.isa().name());
        }
        let (a, b) = (f32s(&a), f32s(&b));
        if !non_finite {
            assert!(
                a.iter().all(|v| v.is_finite()),
                "finite inputs, finite outputs"
            );
        }
        for (i, (p, q)) in a.iter().zip(&b).enumerate() {
            if p.is_nan() {
                assert!(q.is_nan(), "[{i}]: cpu NaN, emu {q}");
            } else {
                assert_eq!(p.to_bits(), q.to_bits(), "[{i}]: cpu {p}, emu {q}");
            }
        }
    }
}

/// Rejected gated pools: typed errors naming what is wrong, outputs untouched.
fn gated_pool_rejections<B: ModelOps<Buffer = CpuBuffer>>(b: &B) {
    let (entries, span, width, rows) = (3, 4, 5, 6);
    const E: u32 = GatedPool::EMPTY;
    let good: Vec<u32> = vec![0, E, 5, 1, E, E, 2, E, 3, 3, 3, 3];
    let x = buf(&vec![0.5; rows * 2 * width]);
    let bias = buf(&vec![0.25; span * width]);
    let op = GatedPool {
        entries,
        span,
        width,
        sources: &good,
        rows,
    };
    let mut out = poisoned(entries * width);
    let detail = |e: Result<(), Error>| match e {
        Err(Error::InvalidArgument { detail, .. }) => detail,
        other => panic!("want InvalidArgument, got {other:?}"),
    };
    // Span 0, width 0.
    let d = detail(ModelOps::gated_pool(
        b,
        &GatedPool {
            span: 0,
            sources: &[],
            ..op
        },
        &x,
        &buf(&[]),
        &mut out,
    ));
    assert!(d.contains("span"), "{d}");
    let d = detail(ModelOps::gated_pool(
        b,
        &GatedPool { width: 0, ..op },
        &buf(&[]),
        &buf(&[]),
        &mut poisoned(0),
    ));
    assert!(d.contains("width"), "{d}");
    // A source id past x's rows (not the empty marker).
    let mut bad = good.clone();
    bad[6] = rows as u32;
    let d = detail(ModelOps::gated_pool(
        b,
        &GatedPool {
            sources: &bad,
            ..op
        },
        &x,
        &bias,
        &mut out,
    ));
    assert!(d.contains("entry 1 slot 2"), "{d}");
    // An entry whose slots are all empty.
    let mut bad = good.clone();
    bad[8..12].fill(E);
    let d = detail(ModelOps::gated_pool(
        b,
        &GatedPool {
            sources: &bad,
            ..op
        },
        &x,
        &bias,
        &mut out,
    ));
    assert!(d.contains("entry 2"), "{d}");
    // Sources of the wrong length.
    let e = ModelOps::gated_pool(
        b,
        &GatedPool {
            sources: &good[..11],
            ..op
        },
        &x,
        &bias,
        &mut out,
    );
    assert!(matches!(e, Err(Error::Shape { .. })), "{e:?}");
    // x, bias, out of the wrong size.
    let e = ModelOps::gated_pool(b, &op, &buf(&vec![0.5; rows * width]), &bias, &mut out);
    assert!(matches!(e, Err(Error::BufferSize { .. })), "{e:?}");
    let e = ModelOps::gated_pool(b, &op, &x, &buf(&[0.25; 19]), &mut out);
    assert!(matches!(e, Err(Error::BufferSize { .. })), "{e:?}");
    let mut short = poisoned(entries * width - 1);
    let e = ModelOps::gated_pool(b, &op, &x, &bias, &mut short);
    assert!(matches!(e, Err(Error::BufferSize { .. })), "{e:?}");
    assert!(
        f32s(&short).iter().all(|v| v.is_nan()),
        "a rejected call wrote"
    );
    assert!(
        f32s(&out).iter().all(|v| v.is_nan()),
        "a rejected call wrote"
    );
    // And the good call writes every element.
    ModelOps::gated_pool(b, &op, &x, &bias, &mut out).unwrap();
    assert!(f32s(&out).iter().all(|v| *v == 0.5));
}
