use rand::{Rng, SeedableRng};
use std::time::Instant;
fn main() {
    let (n, k) = (65536usize, 2048usize);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let rows = 64;
    let data: Vec<f32> = (0..n * rows).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
    let mut dst = vec![0i32; k];
    for isa in sparsekit_host::cpu::CpuIsa::available() {
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            for r in 0..rows {
                sparsekit_host::cpu::topk::select_row_isa(isa, &data[r * n..][..n], k, &mut dst);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("{:?}: {:.1} us/row, {:.2} GB/s", isa.isa(), best / rows as f64 * 1e6, (n * rows * 4) as f64 / best / 1e9);
    }
}
