"""llama-server's placement flags, read with llama-server's meaning (bloomery/placement_flags.py, settings.py)."""
import pytest

from bloomery.placement_flags import EXPS_PATTERN, Override, PlacementAsk, PlacementFlagError, read
from bloomery.settings import SettingsError, parse

READ = [   # argv after -m, the PlacementAsk it gives
    (["--cpu-moe"], PlacementAsk(cpu_moe=True)),
    (["-cmoe"], PlacementAsk(cpu_moe=True)),
    (["-ncmoe", "3"], PlacementAsk(n_cpu_moe=3)),
    (["--n-cpu-moe", "0"], PlacementAsk(n_cpu_moe=0)),
    (["-ot", "exps=CPU"], PlacementAsk(overrides=(Override("exps", "CPU"),))),
    (["--override-tensor", r"blk\.[0-3]\.ffn_.*_exps=CPU,output=CUDA0"],
     PlacementAsk(overrides=(Override(r"blk\.[0-3]\.ffn_.*_exps", "CPU"), Override("output", "CUDA0")))),
    (["-ot", "a=CPU", "-ot", "b=CUDA1"], PlacementAsk(overrides=(Override("a", "CPU"), Override("b", "CUDA1")))),
    (["-fit", "off"], PlacementAsk(fit=False)),
    (["--fit", "on"], PlacementAsk(fit=True)),
    (["-fit", "disabled"], PlacementAsk(fit=False)),
    (["-fitt", "2048"], PlacementAsk(fit_target_mib=(2048,))),
    (["--fit-target", "100,200/300"], PlacementAsk(fit_target_mib=(100, 200, 300))),
    (["-fitc", "8192"], PlacementAsk(fit_ctx=8192)),
    (["--fit-ctx", "1024"], PlacementAsk(fit_ctx=1024)),
    (["-ts", "3,1"], PlacementAsk(tensor_split=(3.0, 1.0))),
    (["--tensor-split", "1/1"], PlacementAsk(tensor_split=(1.0, 1.0))),
    (["-mg", "1"], PlacementAsk(main_gpu=1)),
    (["--main-gpu", "0"], PlacementAsk(main_gpu=0)),
    (["-sm", "none"], PlacementAsk(split_mode="none")),
    (["--split-mode", "layer"], PlacementAsk(split_mode="layer")),
]


@pytest.mark.parametrize("argv,ask", READ, ids=[" ".join(a) for a, _ in READ])
def test_each_spelling_is_read_with_one_record(argv, ask):
    s = parse(["-m", "x.gguf", *argv], env={})
    assert s.placement_ask == ask
    lines = [kv for msg, kv in s.notes if msg == "placement flag read"]
    assert len(lines) == 1 and lines[0]["read"]


def test_env_variables_are_read():
    s = parse(["-m", "x.gguf"], env={"LLAMA_ARG_N_CPU_MOE": "5", "LLAMA_ARG_OVERRIDE_TENSOR": "exps=CPU",
                                     "LLAMA_ARG_FIT_TARGET": "512", "LLAMA_ARG_CPU_MOE": "1"})
    assert s.placement_ask == PlacementAsk(cpu_moe=True, n_cpu_moe=5, overrides=(Override("exps", "CPU"),),
                                           fit_target_mib=(512,))


BAD = [
    (["-ncmoe", "-1"], "-ncmoe -1: must be >= 0"),
    (["-ncmoe", "two"], "-ncmoe 'two': takes an integer"),
    (["-ot", "exps"], "each rule is <tensor name pattern>=<buffer type>"),
    (["-ot", "=CPU"], "the tensor name pattern is empty"),
    (["-ot", "blk.(=CPU"], "is not a regular expression"),
    (["-ot", "exps=GPU"], "unknown buffer type 'GPU'"),
    (["-ot", "exps=cuda0"], "unknown buffer type 'cuda0'"),
    (["-ot", "exps=CUDA01"], "unknown buffer type 'CUDA01'"),
    (["-fit", "maybe"], "-fit 'maybe': takes on or off"),
    (["-fitt", "1024,"], "no empty item"),
    (["-fitt", "-5"], "no item may be negative"),
    (["-fitt", "1.5"], "every item must be a number"),
    (["-ts", "0,0"], "every share is 0"),
    (["-ts", "a,1"], "every item must be a number"),
    (["-mg", "-1"], "-mg -1: must be >= 0"),
    (["-sm", "row"], "-sm row: splitting one layer's weights over cards is not served"),
    (["-sm", "rows"], "-sm 'rows': takes none or layer"),
    (["-fitc", "-3"], "-fitc -3: must be >= 0"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_refused_by_name(argv, message):
    with pytest.raises(SettingsError) as e:
        parse(["-m", "x.gguf", *argv], env={})
    assert message in str(e.value)


def test_device_of_follows_llama_server_rules():
    ask = PlacementAsk(n_cpu_moe=2)
    assert ask.device_of("blk.1.ffn_up_exps.weight") == ("host", "-ncmoe 2")
    assert ask.device_of("blk.2.ffn_up_exps.weight") is None
    assert ask.device_of("blk.11.ffn_up_exps.weight") is None
    assert ask.device_of("blk.0.ffn_gate_inp.weight") is None       # the router is not an expert
    assert ask.device_of("blk.0.ffn_down_shexp.weight") is None     # nor the shared expert
    cm = PlacementAsk(cpu_moe=True)
    assert cm.device_of("blk.7.ffn_gate_exps.weight") == ("host", "--cpu-moe")
    assert cm.device_of("blk.7.attn_q.weight") is None
    ot = PlacementAsk(cpu_moe=True, overrides=(Override(r"blk\.7\.", "CUDA0"),))
    assert ot.device_of("blk.7.ffn_gate_exps.weight") == ("cuda:0", r"-ot blk\.7\.=CUDA0")   # -ot first
    assert EXPS_PATTERN in r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def test_read_is_pure_and_names_the_spelling():
    with pytest.raises(PlacementFlagError, match=r"^-ot 'x=Metal': unknown buffer type"):
        read({"--override-tensor": ("-ot", "x=Metal")})
    ask, notes = read({})
    assert ask == PlacementAsk() and notes == [] and not ask.explicit
    assert PlacementAsk(fit_target_mib=(10, 20)).margin_bytes(1) == 20 << 20
    assert PlacementAsk(fit_target_mib=(10,)).margin_bytes(3) == 10 << 20
