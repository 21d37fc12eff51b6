// TensorRT IPluginV3 for attnx::MawDepthGather (plugin "MawDepthGather", version "1", namespace "attnx"),
// and its creator.
//
//   q_depth [B,H,Lq,d] T, k_depth [B,H,Lk,d] T, policy_logits [B,d] T
//   -> q_sel [B,H,Lq,1] T, k_sel [B,H,Lk,1] T, depth [B] int64      (T = float32 | float16, linear)
// The inputs follow MawDepthSelect's shape rules; no attributes.
#ifndef ATTNX_MAW_DEPTH_GATHER_PLUGIN_H
#define ATTNX_MAW_DEPTH_GATHER_PLUGIN_H

#include "common/plugin_v3.h"

namespace attnx
{
namespace plugin
{

class MawDepthGatherPlugin final : public PluginV3<MawDepthGatherPlugin>
{
public:
    using PluginV3::PluginV3;

    static constexpr char const* kName = "MawDepthGather";
    static constexpr int32_t kNbInputs = 3;
    static constexpr int32_t kNbOutputs = 3;
    static constexpr int32_t kFirstInt64Output = 2;
    static constexpr char const* kIoNames[] = {"q_depth", "k_depth", "policy_logits", "q_sel", "k_sel", "depth"};
    static constexpr int32_t kInputRanks[] = {4, 4, 2};

    static void checkShapes(nvinfer1::Dims const* inputs, ShapeChecker& c);
    static void outputShapes(
        nvinfer1::DimsExprs const* inputs, nvinfer1::DimsExprs* outputs, nvinfer1::IExprBuilder& exprBuilder);
    int launch(int dtype, nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs, void* const* outputs,
        void* workspace, cudaStream_t stream) const noexcept;
};

using MawDepthGatherCreator = PluginCreatorV3<MawDepthGatherPlugin>;

} // namespace plugin
} // namespace attnx

#endif // ATTNX_MAW_DEPTH_GATHER_PLUGIN_H
