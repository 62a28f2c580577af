use sparsekit_host::CpuBackend;
use sparsekit_server::engine::*;
use sparsekit_server::metrics::Metrics;
use std::sync::Arc;
use std::time::Instant;
fn main() {
    let e = Engine::start(
        Arc::new(CpuBackend::new()),
        ModelConfig::TINY,
        EngineOptions {
            kv_pages: 2048,
            ..Default::default()
        },
        Arc::new(Metrics::new("both")),
    )
    .unwrap();
    for &len in &[512usize, 2048, 4096] {
        let prompt: Vec<u32> = (0..len).map(|i| (i * 7 % 256) as u32).collect();
        let t = Instant::now();
        let c = e
            .submit(GenerateRequest {
                id: None,
                prompt: prompt.clone(),
                sampling: SamplingParams {
                    max_new_tokens: 1,
                    ignore_eos: true,
                    ..Default::default()
                },
            })
            .unwrap()
            .wait(std::time::Duration::from_secs(600))
            .unwrap();
        let pf = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let c2 = e
            .submit(GenerateRequest {
                id: None,
                prompt,
                sampling: SamplingParams {
                    max_new_tokens: 65,
                    ignore_eos: true,
                    ..Default::default()
                },
            })
            .unwrap()
            .wait(std::time::Duration::from_secs(600))
            .unwrap();
        let tot = t.elapsed().as_secs_f64();
        println!(
            "ctx {len}: prefill {:.1} ms ({:.1} us/token); decode {:.2} ms/token (batch 1) {} {}",
            pf * 1e3,
            pf * 1e6 / len as f64,
            (tot - pf) * 1e3 / 64.0,
            c.tokens.len(),
            c2.tokens.len()
        );
    }
}
