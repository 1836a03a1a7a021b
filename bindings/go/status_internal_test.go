package minikv

import (
	"strings"
	"testing"

	"minikv.dev/minikv/internal/capi"
)

// The Go constants must equal the pinned C values, and the names the C status strings.
func TestStatusesMatchTheLibrary(t *testing.T) {
	pinned := map[Status]capi.Enum_SS_minikv_status{
		StatusOK:               capi.MINIKV_OK,
		StatusInvalidArgument:  capi.MINIKV_ERR_INVALID_ARGUMENT,
		StatusOutOfMemory:      capi.MINIKV_ERR_OUT_OF_MEMORY,
		StatusCapacityExceeded: capi.MINIKV_ERR_CAPACITY_EXCEEDED,
		StatusBadState:         capi.MINIKV_ERR_BAD_STATE,
		StatusUnsupported:      capi.MINIKV_ERR_UNSUPPORTED,
		StatusDevice:           capi.MINIKV_ERR_DEVICE,
		StatusVersionMismatch:  capi.MINIKV_ERR_VERSION_MISMATCH,
		StatusInternal:         capi.MINIKV_ERR_INTERNAL,
	}
	for s, c := range pinned {
		if int(s) != int(c) {
			t.Errorf("%s = %d, C says %d", s, int(s), int(c))
		}
		if text := capi.Status_string(int(s)); !strings.HasPrefix(text, s.String()+":") {
			t.Errorf("status_string(%d) = %q, want prefix %q", int(s), text, s.String())
		}
	}
	for _, e := range []struct {
		got, want int
	}{
		{int(BackendAuto), int(capi.MINIKV_BACKEND_AUTO)}, {int(BackendCPU), int(capi.MINIKV_BACKEND_CPU)},
		{int(BackendCUDA), int(capi.MINIKV_BACKEND_CUDA)}, {int(DtypeF16), int(capi.MINIKV_DTYPE_F16)},
		{int(DtypeBF16), int(capi.MINIKV_DTYPE_BF16)}, {int(DtypeF32), int(capi.MINIKV_DTYPE_F32)},
		{int(BudgetUniform), int(capi.MINIKV_BUDGET_UNIFORM)}, {int(BudgetPyramid), int(capi.MINIKV_BUDGET_PYRAMID)},
		{int(ScoreCumulative), int(capi.MINIKV_SCORE_CUMULATIVE)}, {int(ScoreWindow), int(capi.MINIKV_SCORE_WINDOW)},
		{int(PresetBalanced), int(capi.MINIKV_PRESET_BALANCED)}, {int(PresetPaper), int(capi.MINIKV_PRESET_PAPER)},
		{int(PresetQuality), int(capi.MINIKV_PRESET_QUALITY)}, {int(PresetEvictionOnly), int(capi.MINIKV_PRESET_EVICTION_ONLY)},
	} {
		if e.got != e.want {
			t.Errorf("enum value %d, C says %d", e.got, e.want)
		}
	}
}

// Config survives the Go → C → Go round trip field by field (a field missed in toC would
// silently keep its default).
func TestConfigRoundTrip(t *testing.T) {
	in := Config{BackendCUDA, 3, DtypeBF16, 5, 12, 4, 80, 7, 999, 12345, 0.125, 0.375,
		BudgetPyramid, 3.5, ScoreWindow, 17, 5, 4, 16, 32, 64, 9, 321, 48}
	c := in.toC()
	defer capi.DeleteConfigStruct(c)
	if c.GetStruct_size() == 0 {
		t.Fatal("struct_size not set")
	}
	out := Config{Backend(c.GetBackend()), int32(c.GetDevice_id()), Dtype(c.GetDtype()),
		uint32(c.GetNum_layers()), uint32(c.GetNum_heads()), uint32(c.GetNum_kv_heads()),
		uint32(c.GetHead_dim()), uint32(c.GetMax_sequences()), uint32(c.GetMax_seq_len()),
		c.GetMax_tokens(), c.GetHeavy_ratio(), c.GetRecent_ratio(), BudgetPolicy(c.GetBudget_policy()),
		c.GetPyramid_depth(), ScoreMode(c.GetScore_mode()), uint32(c.GetWindow_size()),
		uint32(c.GetPool_kernel()), uint32(c.GetKey_bits()), uint32(c.GetValue_bits()),
		uint32(c.GetGroup_size()), uint32(c.GetResidual_length()), uint32(c.GetSink_tokens()),
		uint32(c.GetPrefill_staging_tokens()), uint32(c.GetFlush_tokens())}
	if in != out {
		t.Fatalf("round trip\n in  %+v\n out %+v", in, out)
	}
	d := DefaultConfig()
	if d.KeyBits != 4 || d.ValueBits != 2 || d.GroupSize != 32 || d.ResidualLength != 64 ||
		d.SinkTokens != 4 || d.HeavyRatio != 0.25 || d.RecentRatio != 0.25 || d.Dtype != DtypeF16 ||
		d.MaxSequences != 1 || d.PrefillStagingTokens != 0 || d.FlushTokens != 32 {
		t.Fatalf("DefaultConfig %+v is not the documented default", d)
	}
}

// The version rule (MINIKV_VERSION_COMPATIBLE): the same major version, and not older than
// the binding; the library under test (this tree's) passes it.
func TestVersionRule(t *testing.T) {
	const built = BindingVersionNumber
	if int(built) != capi.MINIKV_VERSION_NUMBER {
		t.Fatalf("BindingVersionNumber %d, the header cgo compiled against says %d", built,
			capi.MINIKV_VERSION_NUMBER)
	}
	const major = built / 10000
	cases := []struct {
		loaded uint32
		want   bool
	}{
		{built, true}, {built + 1, true}, {built + 100, true}, {major*10000 + 9999, true},
		{(major + 1) * 10000, false}, {(major+1)*10000 + built%10000, false},
	}
	if built%10000 != 0 {
		cases = append(cases, struct {
			loaded uint32
			want   bool
		}{built - 1, false})
	}
	for _, c := range cases {
		if got := compatible(built, c.loaded); got != c.want {
			t.Errorf("compatible(%d, %d) = %v, want %v", built, c.loaded, got, c.want)
		}
	}
	if !compatible(built, VersionNumber()) {
		t.Errorf("the loaded library %s does not serve the binding (%d)", Version(), built)
	}
}
