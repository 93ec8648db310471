//! The CPU kernel family: the widest SIMD the CPU has (AVX-512, AVX2 with FMA and F16C, Arm's
//! NEON, or portable code), or one forced with `--cpu-kernels` for tests and comparisons.
//! Each [`super::CpuDevice`] holds its family: its weights are laid out for it at load (the
//! SIMD families share the packed panel layout of `packed.rs`; a portable device keeps
//! row-major weights) and its kernels run it.

/// What `--cpu-kernels` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CpuKernels {
    /// The widest family this CPU supports.
    #[default]
    Auto,
    Avx512,
    Avx2,
    Neon,
    Portable,
}

/// A family the kernels run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// AVX-512F.
    Avx512,
    /// AVX2, FMA and F16C.
    Avx2,
    /// Arm's Advanced SIMD (every aarch64 CPU).
    Neon,
    /// Plain Rust (the `gemm` crate, which dispatches by itself, for matmuls).
    Portable,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Avx512 => "avx512",
            Family::Avx2 => "avx2+fma",
            Family::Neon => "neon",
            Family::Portable => "portable",
        }
    }

    /// Whether this CPU can run the family.
    pub fn supported(self) -> bool {
        match self {
            Family::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Family::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Family::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "aarch64")]
            Family::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            _ => false,
        }
    }

    /// The `--cpu-kernels` value that asks for this family.
    pub fn arg(self) -> CpuKernels {
        match self {
            Family::Avx512 => CpuKernels::Avx512,
            Family::Avx2 => CpuKernels::Avx2,
            Family::Neon => CpuKernels::Neon,
            Family::Portable => CpuKernels::Portable,
        }
    }

    /// Every family this CPU can run, widest first.
    pub fn all_supported() -> Vec<Family> {
        [Family::Avx512, Family::Avx2, Family::Neon, Family::Portable]
            .into_iter()
            .filter(|f| f.supported())
            .collect()
    }
}

impl Default for Family {
    /// The widest family this CPU supports.
    fn default() -> Self {
        Family::all_supported()[0]
    }
}

/// The family `want` names on this CPU; an error names what this CPU lacks.
pub fn choose(want: CpuKernels) -> Result<Family, String> {
    let f = match want {
        CpuKernels::Auto => return Ok(Family::default()),
        CpuKernels::Avx512 => Family::Avx512,
        CpuKernels::Avx2 => Family::Avx2,
        CpuKernels::Neon => Family::Neon,
        CpuKernels::Portable => Family::Portable,
    };
    if !f.supported() {
        let have: Vec<&str> = Family::all_supported().iter().map(|f| f.name()).collect();
        return Err(format!("--cpu-kernels {}: this CPU supports {}", f.name(), have.join(", ")));
    }
    Ok(f)
}
