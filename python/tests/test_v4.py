

def test_copy_pages_and_checksums_of_v4_pools(rng):
    for layout in (KvLayout("model1_fp8", page_size=37), KvLayout("bf16_512", page_size=3),
                   IndexKLayout("fp4_e2m1", 128, 5)):
        src = torch.from_numpy(_pool(rng, 6, layout.bytes_per_page))
        dst = torch.from_numpy(_pool(rng, 4, layout.bytes_per_page))
        before = dst.clone()
        si, di = torch.tensor([5, 0, 3], dtype=torch.int32), torch.tensor([2, 3, 0], dtype=torch.int32)
        ops.copy_pages(src, dst, si, di, layout)
        want = before.clone()
        want[di.long()] = src[si.long()]
        assert torch.equal(dst, want), _msg(f"copy_pages {layout!r}")
        sums = ops.page_checksums(dst, torch.tensor([0, 2, 1], dtype=torch.int32), layout)
        assert sums[0] == sums[0] and sums[0] != sums[2] or torch.equal(dst[0], dst[2]), _msg("checksums")
        again = ops.page_checksums(src, si, layout)
        assert torch.equal(again, ops.page_checksums(dst, di, layout)), _msg(f"checksums {layout!r}")
