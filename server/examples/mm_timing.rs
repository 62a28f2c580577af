use sparsekit_host::cpu::CpuBuffer;
use sparsekit_host::model_ops::*;
use sparsekit_host::CpuBackend;
use std::time::Instant;
fn main() {
    let b = CpuBackend::new();
    for &(m, k, n, g) in &[
        (256usize, 64usize, 1024usize, 1usize),
        (256, 32, 256, 16),
        (256, 256, 32, 16),
        (256, 512, 128, 1),
        (256, 128, 512, 1),
        (256, 128, 8, 1),
        (1, 64, 1024, 1),
        (1, 512, 128, 1),
    ] {
        let x = CpuBuffer::from_bytes(bytemuck::cast_slice(&vec![0.5f32; m * g * k]));
        let w = CpuBuffer::from_bytes(bytemuck::cast_slice(&vec![0.25f32; g * k * n]));
        let mut o = CpuBuffer::zeroed(m * g * n * 4);
        let op = Matmul {
            rows: m,
            groups: g,
            k,
            n,
            x: View::grouped(g, k),
            out: View::grouped(g, n),
            accumulate: Accumulate::Overwrite,
        };
        let reps = 200;
        let t = Instant::now();
        for _ in 0..reps {
            b.matmul(&op, &x, &w, &mut o).unwrap();
        }
        let dt = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "m{m} k{k} n{n} g{g}: {:.1} us, {:.1} GFLOP/s",
            dt * 1e6,
            2.0 * (m * k * n * g) as f64 / dt / 1e9
        );
    }
}
