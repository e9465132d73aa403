//! Choosing FlashDecoding++'s unified max `φ` from a model's scores ([`calibrate_phi`]).

use super::*;

/// What [`calibrate_phi`] chose.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Calibration {
    /// The unified max for [`DecodeOptions::phi`].
    pub phi: f32,
    /// The safe window it was chosen for (give the same to [`DecodeOptions::safe_range`]).
    pub safe_range: (f32, f32),
    /// The fraction of the sample's rows whose largest score falls outside `φ + [lo, hi]`: the
    /// fallback rate to expect on calls like the sample's.
    pub expected_fallback: f64,
    /// The sample's finite row maxima (the others count as falling back).
    pub samples: usize,
}

/// FlashDecoding++'s unified max `φ` from a model's scores, as the paper chooses it offline per
/// model.
///
/// A row runs FlashDecoding++'s fast path when its largest score `m` lies in the safe window,
/// `φ + lo ≤ m ≤ φ + hi` (`safe_range`; `None`: the default of `dtype`, [`default_safe_range`],
/// ±5.55 for fp16); otherwise FlashDecoding recomputes it. So the `φ` that sends the fewest rows
/// back is the one whose window, of fixed width `hi − lo`, covers the most of the model's row
/// maxima: the densest interval of that width in their distribution, which one sweep over the
/// sorted sample finds. `row_maxima` is such a sample: the largest score `scale · q·k` (after any
/// score modifier, in the units of the scores) of each query row of real calls
/// (`ladder_reference::flash_decoding_pp::row_maxima` computes them on the CPU). The returned `φ`
/// is centred in that interval, so that a drift of the scores either way costs the least, with
/// the fraction of the sample left outside (non-finite maxima count as outside). An empty sample,
/// or one without a finite value, is an error.
pub fn calibrate_phi(
    row_maxima: &[f32],
    safe_range: Option<(f32, f32)>,
    dtype: DType,
) -> Result<Calibration> {
    let (lo, hi) = safe_range.unwrap_or_else(|| default_safe_range(dtype));
    let mut m: Vec<f32> = row_maxima.iter().copied().filter(|x| x.is_finite()).collect();
    if m.is_empty() {
        return Err(KernelError::Config(format!(
            "calibrate_phi: no finite row maximum among {} samples",
            row_maxima.len()
        )));
    }
    m.sort_by(f32::total_cmp);
    // The densest window [m[i], m[i] + width]: for each left end, the last sample it reaches.
    let width = hi - lo;
    let (mut best, mut best_at, mut end) = (0, (0, 0), 0);
    for i in 0..m.len() {
        end = end.max(i);
        while end + 1 < m.len() && m[end + 1] - m[i] <= width {
            end += 1;
        }
        if end - i + 1 > best {
            (best, best_at) = (end - i + 1, (i, end));
        }
    }
    // Centred: the window [φ + lo, φ + hi] has as much room below m[first] as above m[last].
    let (first, last) = (m[best_at.0], m[best_at.1]);
    let phi = (first + last - lo - hi) / 2.0;
    let outside = row_maxima.len() - best;
    // The window (checked as a call would: finite φ, lo < hi ≤ ln MAX).
    Window::new(phi, Some((lo, hi)), dtype)?;
    Ok(Calibration {
        phi,
        safe_range: (lo, hi),
        expected_fallback: outside as f64 / row_maxima.len() as f64,
        samples: m.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phi_centres_the_densest_window_of_the_maxima() {
        // Maxima around 3 (±2), a few outliers at 30: fp16's window ±5.55 covers the bulk.
        let mut maxima: Vec<f32> = (0..1000).map(|i| 1.0 + 4.0 * (i as f32 / 999.0)).collect();
        maxima.extend([30.0, 31.0, f32::NAN]);
        let c = calibrate_phi(&maxima, None, DType::F16).unwrap();
        assert!((c.phi - 3.0).abs() < 1e-5, "{c:?}");
        assert_eq!(c.samples, 1002);
        assert!((c.expected_fallback - 3.0 / 1003.0).abs() < 1e-12, "{c:?}");
        // A narrower window than the spread: the densest part wins, and the rest falls back.
        let c = calibrate_phi(&maxima, Some((-1.0, 1.0)), DType::F16).unwrap();
        assert!((c.expected_fallback - (1003.0 - 500.0) / 1003.0).abs() < 0.01, "{c:?}");
        // Every row inside the window: none falls back.
        let c = calibrate_phi(&[7.5, 8.0, 9.0], None, DType::BF16).unwrap();
        assert_eq!((c.phi, c.expected_fallback), (8.25, 0.0));
    }

    #[test]
    fn bad_samples_and_windows_are_errors() {
        assert!(calibrate_phi(&[], None, DType::F16).is_err());
        assert!(calibrate_phi(&[f32::NAN, f32::INFINITY], None, DType::F16).is_err());
        assert!(calibrate_phi(&[1.0], Some((1.0, -1.0)), DType::F16).is_err());
        assert!(calibrate_phi(&[1.0], Some((-1.0, 20.0)), DType::F16).is_err(), "past ln(65504)");
    }
}
