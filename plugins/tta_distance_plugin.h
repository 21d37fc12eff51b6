// TensorRT IPluginV3 for attnx::TtaDistance (plugin "TtaDistance", version "1", namespace "attnx").
//
//   q [B,H,Lq,Dh] T, k [B,H,Lk,Dh] T, trace [B|1,H|1,Dh,Dh] T -> dist [B,H,Lq,Lk] T
//   (T = float32 | float16, linear). Workspace: attnx_tta_distance_workspace_size at the max shapes.
#ifndef ATTNX_TTA_DISTANCE_PLUGIN_H
#define ATTNX_TTA_DISTANCE_PLUGIN_H

#include "plugin_common.h"

namespace attnx
{
namespace plugin
{

constexpr char const* kTtaDistanceName = "TtaDistance";

class TtaDistancePlugin final : public PluginBase
{
public:
    explicit TtaDistancePlugin(std::string nodeName);

    // IPluginV3
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override
    {
        return 1;
    }
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

    //! Empty when q/k/trace dims are consistent (-1 = unknown, skipped), else the reasons.
    static std::string checkShapes(nvinfer1::Dims const& q, nvinfer1::Dims const& k, nvinfer1::Dims const& trace);

private:
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

class TtaDistanceCreator final : public nvinfer1::IPluginCreatorV3One
{
public:
    TtaDistanceCreator() = default;
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override
    {
        return &mFieldCollection;
    }
    char const* getPluginName() const noexcept override
    {
        return kTtaDistanceName;
    }
    char const* getPluginVersion() const noexcept override
    {
        return kPluginVersion;
    }
    char const* getPluginNamespace() const noexcept override
    {
        return kPluginNamespace;
    }

private:
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

} // namespace plugin
} // namespace attnx

#endif // ATTNX_TTA_DISTANCE_PLUGIN_H
